"""The GPU's busy share for the console, ``/api/v1/status`` and Prometheus (NVML).

NVML (``pip install nvidia-ml-py``, which the ``[gpu]`` extra brings) reports the share of the
last sample period (1/6 s to 1 s, by device) in which a kernel ran on the GPU. Without NVML or
an NVIDIA GPU the figure is None, and the node goes on.
"""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.Lock()
_handle: list[Any] = []  # [pynvml module, device handle] once NVML is up; [None] if it is not


def gpu_busy_percent(index: int = 0) -> int | None:
    """GPU ``index``'s utilisation in percent (NVML), or None without NVML or a GPU."""
    with _lock:
        if not _handle:
            try:
                import pynvml

                pynvml.nvmlInit()
                _handle.extend([pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)])
            except Exception:
                _handle.append(None)
    if _handle[0] is None:
        return None
    try:
        return int(_handle[0].nvmlDeviceGetUtilizationRates(_handle[1]).gpu)
    except Exception:
        return None
