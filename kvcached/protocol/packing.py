"""Packed structs whose fields are named once, in their order on the wire."""

from __future__ import annotations

import struct
from typing import Any


class Table:
    """A packed struct, packed from and unpacked to mappings by field name, never by position."""

    def __init__(self, *fields: tuple[str, str]) -> None:
        self.names = tuple(name for name, _ in fields)
        self.struct = struct.Struct("<" + "".join(code for _, code in fields))
        self.size = self.struct.size
        #: Width of each ``Ns`` (bytes) field.
        self.widths = {name: int(code[:-1]) for name, code in fields if code.endswith("s")}

    def pack(self, values: dict[str, Any]) -> bytes:
        return self.struct.pack(*(values[name] for name in self.names))

    def pack_into(self, buffer: Any, offset: int, values: dict[str, Any]) -> None:
        self.struct.pack_into(buffer, offset, *(values[name] for name in self.names))

    def unpack(self, buffer: Any, offset: int = 0) -> dict[str, Any]:
        return dict(zip(self.names, self.struct.unpack_from(buffer, offset), strict=True))
