"""kvcached in FastDeploy's place: a drop-in for its cache transfer manager (``transfer_manager``), behind
one adapter for everything FastDeploy-facing (``adapter``)."""
