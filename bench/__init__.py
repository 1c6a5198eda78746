"""Workloads, harnesses, peers and the soak. Benches run as `python -m radixserve.bench.NAME`, often from the
checkout's root: the checkout's folders must not shadow other packages (frontend.drop_checkout_root)."""
from ..frontend import drop_checkout_root

drop_checkout_root()
