#!/usr/bin/env python3
"""Run the handshake, swap and store benchmarks and write a Markdown report with PNG plots.

Every figure stands beside the physical limit measured in the same run by the benchmark itself: a plain
``np.copyto`` of the same bytes (swap), plain write+fsync+rename / read (warm and cold) and plain Mooncake
put / get (store), FastDeploy's ``sleep(1)`` poll (handshake). Writes, into ``--out``:

* ``report.md``: FastDeploy's geometries first (swap, the file store at its object size, the start), then the
  headline figures at the other sizes, then each benchmark's full printout;
* ``swap_throughput.png``: swap-out / swap-in GB/s against the layer-block size, with the plain-copy line;
* ``wakeup_latency.png``: the distribution of wake-up latencies, kvcached against the ``sleep(1)`` poll;
* ``store_throughput.png``: store and load GB/s per backend beside the plain I/O of the same objects.

It also runs ``bench_swap.py --geometry`` for FastDeploy's TP8 and MLA geometries (runs and shuffled ids
beside the plain copy), ``bench_store.py`` on the file store at a TP8 70B Llama's block (80 layers x K,V
x 16 KiB = 2.5 MiB in 160 pieces; ERNIE-4.5's, 54 layers, is 1.7 MiB in 108) and ``bench_start.py`` (cold
start beside the raw allocation, start after kill -9, restarts under a swap stream).

The default sizes take about 2 minutes on a 2-core machine (docs/benchmarks.md says how long its run
took); ``--smoke`` runs tiny sizes, every benchmark at once (a check that the pipeline works, not a
measurement). Needs the ``plot`` extra: ``pip install -e '.[plot]'``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from helpfmt import show_defaults

ROOT = Path(__file__).resolve().parent.parent
#: Mooncake's client logs through glog on stdout: "I1129 20:15:11.684504 26658 real_client.cpp:1026] ...".
GLOG_LINE = re.compile(r"^[IWEF]\d{4} \d")
SCRIPTS = ROOT / "scripts"

GEOMETRIES = ["--geometry", "tp8-ernie", "--geometry", "tp8-llama70b", "--geometry", "mla-576"]
#: The file store at a TP8 70B Llama's block: 80 layers x K,V x 16 KiB = 2.5 MiB in 160 pieces.
TP8_OBJECT = ["--backends", "file", "--ranks", "1", "--block-kib", "2560", "--layers", "80"]
#: Per benchmark: its arguments at the default size and at --smoke size.
PLANS: dict[str, dict[str, list[str]]] = {
    "handshake": {
        "default": ["--iterations", "10", "--wait-seconds", "3"],
        "smoke": ["--iterations", "2", "--wait-seconds", "1"],
    },
    "swap": {
        "default": ["--gib", "0.5", "--repeats", "1", "--latency-iterations", "500"],
        "smoke": ["--gib", "0.03", "--repeats", "1", "--latency-iterations", "20", "--pieces-kib", "16,256"],
    },
    "store": {
        "default": ["--gib", "0.25", "--repeats", "1"],
        "smoke": ["--gib", "0.02", "--repeats", "1"],
    },
    "geometry": {
        "default": ["--gib", "0.5", "--repeats", "1", "--latency-iterations", "200", *GEOMETRIES],
        "smoke": ["--gib", "0.03", "--repeats", "1", "--latency-iterations", "20", *GEOMETRIES],
    },
    "fdstore": {
        "default": [*TP8_OBJECT, "--gib", "0.25", "--batch", "32", "--repeats", "3"],
        "smoke": [*TP8_OBJECT, "--gib", "0.02", "--batch", "4", "--repeats", "1"],
    },
    "start": {
        "default": ["--ranks", "2", "--gib", "1", "--restarts", "3"],
        "smoke": ["--ranks", "2", "--gib", "0.05", "--restarts", "1"],
    },
}
#: Which script each plan runs (``scripts/bench_<script>.py``).
SCRIPT = {"handshake": "handshake", "swap": "swap", "store": "store", "geometry": "swap", "fdstore": "store"}
SCRIPT["start"] = "start"


@dataclasses.dataclass
class Running:
    """A benchmark started by ``start_benchmark``: its process, where its output goes, when it started."""

    name: str
    proc: subprocess.Popen[bytes]
    stdout: IO[bytes]
    stderr: IO[bytes]
    figures: Path
    started: float


def start_benchmark(name: str, size: str, out: Path, extra: list[str]) -> Running:
    """Start ``scripts/bench_<name>.py`` (its output into temporary files: nothing blocks on a full pipe)."""
    figures = out / f"{name}.json"
    stdout, stderr = tempfile.TemporaryFile(), tempfile.TemporaryFile()  # noqa: SIM115 - closed in finish
    command = [sys.executable, str(SCRIPTS / f"bench_{SCRIPT[name]}.py"), *PLANS[name][size], *extra]
    proc = subprocess.Popen([*command, "--json", str(figures)], stdout=stdout, stderr=stderr, cwd=ROOT)
    return Running(name, proc, stdout, stderr, figures, time.monotonic())


def finish_benchmark(running: Running) -> tuple[dict[str, Any], str, float]:
    """Wait for a started benchmark; its JSON figures, its printout and how long it took."""
    code = running.proc.wait()
    took = time.monotonic() - running.started
    texts = []
    for stream in (running.stdout, running.stderr):
        stream.seek(0)
        texts.append(stream.read().decode(errors="replace"))
        stream.close()
    if code != 0:
        raise SystemExit(f"bench_{SCRIPT[running.name]}.py failed (exit {code}):\n{texts[0]}\n{texts[1]}")
    printout = "\n".join(line for line in texts[0].splitlines() if not GLOG_LINE.match(line))
    return json.loads(running.figures.read_text()), printout, took


def run_benchmark(name: str, size: str, out: Path, extra: list[str]) -> tuple[dict[str, Any], str, float]:
    """Run ``scripts/bench_<name>.py``; its JSON figures, its printout and how long it took."""
    return finish_benchmark(start_benchmark(name, size, out, extra))


def run_benchmarks(
    size: str, out: Path, extra: dict[str, list[str]], *, together: bool
) -> dict[str, tuple[dict[str, Any], str, float]]:
    """Run every benchmark of ``PLANS``: one after the other (each measures on a machine the others leave
    alone), or, ``together``, all at once (--smoke measures nothing: it checks the pipeline)."""
    ran: dict[str, tuple[dict[str, Any], str, float]] = {}
    if not together:
        for name in PLANS:
            ran[name] = run_benchmark(name, size, out, extra.get(name, []))
        return ran
    runs = [start_benchmark(name, size, out, extra.get(name, [])) for name in PLANS]
    try:
        for running in runs:
            ran[running.name] = finish_benchmark(running)
    finally:
        for running in runs:
            if running.proc.poll() is None:  # another benchmark failed: those beside it go too
                running.proc.kill()
                running.proc.wait()
    return ran


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def plot_swap(figures: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    rows = figures["rows"]
    sizes = [r["piece_kib"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(sizes, [r["plain_gbps"] for r in rows], "k--", label="plain np.copyto (same bytes, same run)")
    ax.plot(sizes, [r["out_gbps"] for r in rows], "o-", label="kvcached swap out")
    ax.plot(sizes, [r["in_gbps"] for r in rows], "s-", label="kvcached swap in")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [f"{s} KiB" if s < 1024 else f"{s >> 10} MiB" for s in sizes])
    ax.set_xlabel("layer-block size (one block of one layer's key cache)")
    ax.set_ylabel("GB/s, all ranks")
    ax.set_ylim(bottom=0)
    ax.set_title(f"CPU swap, {figures['ranks']} ranks x {figures['gib']:g} GiB")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_wakeup(figures: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, values in figures["wake_ms"].items():
        ordered = sorted(values)
        shares = [(i + 1) / len(ordered) for i in range(len(ordered))]
        ax.step([ordered[0], *ordered], [0.0, *shares], where="post", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("wake-up latency, READY set -> runner attached (ms, log scale)")
    ax.set_ylabel("share of runs")
    ax.set_ylim(0, 1.02)
    ax.set_title("Handshake: kvcached's semaphore wait against FastDeploy's sleep(1) poll")
    ax.grid(True, alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_store(figures: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 4.2))
    labels, ours, plain = [], [], []
    short = {"mooncake-batch": "mooncake vs\nbatched calls"}
    for backend, passes in figures["backends"].items():
        for op in store_ops(passes):
            labels.append(f"{short.get(backend, backend)}\n{op.replace('_', ' ')}")
            ours.append(statistics.median(p[f"{op}_gbps"] for p in passes))
            plain.append(statistics.median(p[f"plain_{op}_gbps"] for p in passes))
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], plain, width=0.4, label="plain I/O of the same objects", color="0.6")
    ax.bar([i + 0.2 for i in x], ours, width=0.4, label="kvcached")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("GB/s, all ranks")
    ax.set_title(
        f"Attention store, {figures['ranks']} ranks x {figures['gib']:g} GiB, {figures['block_kib']} KiB blocks"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def swap_rows(swap: dict[str, Any]) -> list[str]:
    """One row per case: pipelined, and shuffled, each way against the plain copy."""
    lines = []
    for row in swap["rows"]:
        plain = row["plain_gbps"]
        lines.append(
            f"| swap out / in, {row['case']} ({row['piece_kib']} KiB layer-blocks) | {row['out_gbps']:.2f} / "
            f"{row['in_gbps']:.2f} GB/s; shuffled ids {row['shuffled_out_gbps']:.2f} / {row['shuffled_in_gbps']:.2f} "
            f"| plain copy {plain:.2f} GB/s | {row['out_gbps'] / plain:.2f} / {row['in_gbps'] / plain:.2f}; "
            f"shuffled {row['shuffled_out_gbps'] / plain:.2f} / {row['shuffled_in_gbps'] / plain:.2f} |"
        )
    return lines


def start_rows(start: dict[str, Any]) -> list[str]:
    gib = start["gib"]
    gaps = ", ".join(f"{gap * 1000:.0f}" for gap in start["longest_gaps_s"][:3])
    return [
        f"| cold start, {start['ranks']} ranks x {gib:g} GiB, to READY | {start['cold_s']:.2f} s "
        f"| raw allocation of the same bytes {start['raw_s']:.2f} s | {start['cold_over_raw']:.2f} |",
        f"| start after kill -9 (adopts the memory) | {start['adopt_s']:.2f} s | | |",
        f"| `kvcached restart` under a swap stream | longest gaps {gaps} ms | | |",
    ]


def headline(handshake: dict[str, Any], swap: dict[str, Any], store: dict[str, Any]) -> list[str]:
    ours, poll = handshake["wake_ms"]["kvcached"], handshake["wake_ms"]["sleep(1) poll"]
    cpu = handshake["waiting_cpu_pct"]
    lines = [
        "| benchmark | kvcached | physical limit / baseline, same run | ratio |",
        "|---|---|---|---|",
        f"| wake-up p50 | {percentile(ours, 0.5):.2f} ms | sleep(1) poll {percentile(poll, 0.5):.0f} ms | "
        f"{percentile(poll, 0.5) / percentile(ours, 0.5):.0f}x faster |",
        f"| wake-up p99 | {percentile(ours, 0.99):.2f} ms | sleep(1) poll {percentile(poll, 0.99):.0f} ms | |",
        f"| waiting runner CPU | {cpu['kvcached']:.2f} % of a core | busy loop {cpu['busy `pass` loop']:.0f} % | |",
    ]
    lines += swap_rows(swap)
    for label, rt in swap["round_trip_us"].items():
        lines.append(f"| one-block swap round trip, {label} | p50 {rt['p50']:.0f} us, p99 {rt['p99']:.0f} us | | |")
    return lines + store_rows(store, "") + mooncake_hosts_rows(store.get("mooncake_hosts"))


def store_rows(store: dict[str, Any], what: str) -> list[str]:
    """One row per backend and operation (medians over the passes), each beside the plain side's."""
    names = {
        "file": "plain write+fsync+rename / read",
        "mooncake": "plain Mooncake put / get",
        "mooncake-batch": "batched own-segment put / get",
    }
    lines = []
    for backend, passes in store["backends"].items():
        for op in store_ops(passes):
            o = statistics.median(p[f"{op}_gbps"] for p in passes)
            label = f"| {backend} {op.replace('_', ' ')}{what} | {o:.2f} GB/s"
            b = statistics.median(p[f"plain_{op}_gbps"] for p in passes)
            lines.append(f"{label} | {names.get(backend, backend)} {b:.2f} GB/s | {o / b:.2f} |")
            if f"lmcache_{op}_gbps" in passes[0]:
                lm = statistics.median(p[f"lmcache_{op}_gbps"] for p in passes)
                lines.append(f"{label} | LMCache local disk {lm:.2f} GB/s | {o / lm:.2f} |")
    return lines


def mooncake_hosts_rows(hosts: dict[str, Any] | None) -> list[str]:
    """The cross-host load and the restarted host, when the store benchmark ran Mooncake."""
    if not hosts:
        return []
    ours, batched = (
        statistics.median(hosts["bytes"] / p[k] / 1e9 for p in hosts["passes"]) for k in ("load_s", "batched_get_s")
    )
    restart = hosts["restarts"]["restart"]
    return [
        f"| mooncake cross-host load (host B loads what host A stored) | {ours:.2f} GB/s "
        f"| plain batched get of the same objects {batched:.2f} GB/s | {ours / batched:.2f} |",
        f"| mooncake: `kvcached restart` of host A | host B: {restart['short']} of {restart['lookups']} lookups "
        f"short, longest gap {restart['longest_gap_s'] * 1000:.0f} ms; A serves its prefix again after "
        f"{restart['served_after_s']:.2f} s | | |",
    ]


def store_ops(passes: list[dict[str, float]]) -> list[str]:
    """The operations a backend's passes measured (``store``, ``load`` or ``warm_load``, ``cold_load``)."""
    return [key[: -len("_gbps")] for key in passes[0] if key.endswith("_gbps") and f"plain_{key}" in passes[0]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "bench-report", help="directory for the report")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, every benchmark at once: checks the pipeline, measures nothing",
    )
    parser.add_argument("--store-backends", default=None, help="e.g. file (default: file,mooncake)")
    args = show_defaults(parser).parse_args()
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        raise SystemExit("bench_report.py draws plots with matplotlib: pip install -e '.[plot]'") from None
    args.out.mkdir(parents=True, exist_ok=True)
    size = "smoke" if args.smoke else "default"
    started = time.monotonic()
    store_extra = ["--backends", args.store_backends] if args.store_backends else []
    ran = run_benchmarks(size, args.out, {"store": store_extra}, together=args.smoke)
    (handshake, hs_text, hs_s), (swap, swap_text, swap_s) = ran["handshake"], ran["swap"]
    (store, store_text, store_s), (geometry, geometry_text, geometry_s) = ran["store"], ran["geometry"]
    start, start_text, start_s = ran["start"]
    fdstore, fdstore_text, fdstore_s = ran["fdstore"]
    plot_swap(swap, args.out / "swap_throughput.png")
    plot_wakeup(handshake, args.out / "wakeup_latency.png")
    plot_store(store, args.out / "store_throughput.png")
    total = time.monotonic() - started
    report = [
        "# kvcached benchmark report",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}, "
        f"{'SMOKE sizes (not a measurement)' if args.smoke else 'default sizes'}; "
        f"took {total:.0f} s (handshake {hs_s:.0f} s, swap {swap_s:.0f} s, store {store_s:.0f} s, "
        f"geometries {geometry_s + fdstore_s:.0f} s, start {start_s:.0f} s).",
        "Every ratio compares with the limit measured in the same run: these machines are noisy.",
        "",
        "## FastDeploy's geometries and the start",
        "",
        f"Copy engine: {geometry['copy_engine']}.",
        "",
        "| benchmark | kvcached | physical limit, same run | ratio |",
        "|---|---|---|---|",
        *swap_rows(geometry),
        *store_rows(fdstore, ", TP8 70B Llama block (2.5 MiB, 160 pieces)"),
        *start_rows(start),
        "",
        "## Headline, the other sizes",
        "",
        *headline(handshake, swap, store),
        "",
        "![swap throughput](swap_throughput.png)",
        "",
        "![wake-up latency](wakeup_latency.png)",
        "",
        "![store throughput](store_throughput.png)",
        "",
    ]
    printouts = (
        ("Handshake", hs_text),
        ("Swap", swap_text),
        ("Store", store_text),
        ("Geometries", geometry_text),
        ("The file store at a TP8 70B Llama block", fdstore_text),
        ("Start", start_text),
    )
    for title, text in printouts:
        report += [f"## {title}", "", "```", text.strip(), "```", ""]
    (args.out / "report.md").write_text("\n".join(report))
    print("\n".join([*headline(handshake, swap, store), *swap_rows(geometry), *start_rows(start)]))
    print(f"took {total:.0f} s; report: {args.out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
