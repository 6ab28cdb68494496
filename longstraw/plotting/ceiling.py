"""The memory ceiling a step plot draws, and where it comes from, stated with it: the CUDA device's
total memory on GPU runs; on CPU the RAM the results record, else the RAM of the machine rendering
the report. (Capacity points carry their own configured ceiling; their plot draws that one.)

Two ceilings can stand on one page (a CPU capacity search's emulated one beside the machine's RAM),
so every figure says which one it draws and why (`ceiling_reason`, `search_ceiling_reason`)."""

from __future__ import annotations

import os

from longstraw.plotting.formatting import format_bytes

_RAM_KEYS = ("ram_total_bytes", "memory_total_bytes", "host_memory_total_bytes")

# Why a figure of step points draws the ceiling it draws, by the ceiling's source.
_REASONS = {
    "cuda_total_memory": "the device's memory, where a step runs out",
    "recorded_ram": "the RAM the step points ran in; they have no lower ceiling (a capacity search's emulated "
    "ceiling applies to its own probes only)",
    "machine_ram": "the results recorded no RAM, so it is no limit these points ran under: drawn for scale only",
}


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
            return {
                "bytes": total,
                "source": "cuda_total_memory",
                "label": f"{device} total memory (torch.cuda) {format_bytes(total)}",
            }
    for point in points:
        prov = point.get("provenance") if isinstance(point.get("provenance"), dict) else {}
        for key in _RAM_KEYS:
            if isinstance(prov.get(key), int) and prov[key] > 0:
                return {
                    "bytes": prov[key],
                    "source": "recorded_ram",
                    "label": f"RAM of the measuring machine {format_bytes(prov[key])}, CPU run",
                }
    ram = machine_ram_bytes()
    return {
        "bytes": ram,
        "source": "machine_ram",
        "label": f"RAM of the machine that rendered this report {format_bytes(ram)}, CPU run",
    }


def ceiling_reason(ceiling: dict) -> str:
    """Why a figure of step points draws this ceiling (`memory_ceiling`'s)."""
    return _REASONS.get((ceiling or {}).get("source"), "its source was not recorded")


def search_ceiling_reason(configured: bool, cuda: bool) -> str:
    """Why a capacity search's figure draws its ceiling: the configured one (on CPU an emulated one,
    since the machine's RAM would not run out at these sizes), else the device's memory."""
    if not configured:
        return "the device's memory (no lower ceiling configured): a probe fits when it does not run out"
    if cuda:
        return "the search's configured ceiling (capacity.ceiling_bytes), below the device's memory"
    return (
        "the search's emulated ceiling (capacity.ceiling_bytes): the machine's RAM would not run out at "
        "these sizes, so a probe fits when its RSS growth stays under it"
    )
