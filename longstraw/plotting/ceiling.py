"""The memory ceiling a step plot draws, and where it comes from, stated with it: the CUDA device's
total memory on GPU runs; on CPU the RAM the results record, else the RAM of the machine rendering
the report. (Capacity points carry their own configured ceiling; their plot draws that one.)"""

from __future__ import annotations

import os

from longstraw.plotting.formatting import format_bytes

_RAM_KEYS = ("ram_total_bytes", "memory_total_bytes", "host_memory_total_bytes")


def machine_ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def memory_ceiling(points: list[dict]) -> dict:
    """{"bytes", "label", "source"}: source is cuda_total_memory, recorded_ram or machine_ram."""
    for point in points:
        prov = point.get("provenance") if isinstance(point.get("provenance"), dict) else {}
        total = prov.get("cuda_total_memory_bytes")
        if isinstance(total, int) and total > 0:
            device = prov.get("device") or "CUDA device"
            return {"bytes": total, "source": "cuda_total_memory",
                    "label": f"{device} total memory {format_bytes(total)} (torch.cuda total_memory)"}
    for point in points:
        prov = point.get("provenance") if isinstance(point.get("provenance"), dict) else {}
        for key in _RAM_KEYS:
            if isinstance(prov.get(key), int) and prov[key] > 0:
                return {"bytes": prov[key], "source": "recorded_ram",
                        "label": f"RAM of the measuring machine {format_bytes(prov[key])} (CPU run)"}
    ram = machine_ram_bytes()
    return {"bytes": ram, "source": "machine_ram",
            "label": f"RAM of the machine that rendered this report {format_bytes(ram)} "
                     "(CPU run; not a device ceiling)"}
