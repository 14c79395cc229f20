"""The doctor's output: a table per machine, the collectives' figures, the notes and a verdict (or --json)."""

from __future__ import annotations

from llmtune.doctor.checks import GB, Problem, _machines


def _size(value: float | None) -> str:
    return "-" if value is None else f"{value / GB:.1f} GB"


def _rate(value: float) -> str:
    return f"{value / 1e9:.2f} GB/s" if value >= 1e8 else f"{value / 1e6:.0f} MB/s"


def machine_lines(reports: list[dict]) -> list[str]:
    lines = []
    for host, ranks in _machines(reports).items():
        first = ranks[0]
        stack = first["stack"]
        versions = ", ".join(f"{name} {stack[name]}" for name in ("python", "torch", "transformers", "accelerate",
                                                                  "deepspeed", "peft", "trl", "llmtune", "cuda", "nccl",
                                                                  "driver") if name in stack)  # fmt: skip
        devices = first["devices"]
        gpus = (f"{devices['gpus']} x {devices['gpu_name']}; free per rank: "
                + ", ".join(_size(r["devices"]["free_bytes"]) for r in ranks)) if devices["gpus"] else "no GPU (CPU rehearsal)"  # fmt: skip
        store, net = first["storage"], first["network"]
        inputs = ", ".join(
            f"{key} {'ok' if ok else 'missing'}" for key, ok in store["inputs"].items() if ok is not None
        )
        lines += [
            f"machine {host}: ranks {', '.join(str(r['rank']) for r in ranks)}",
            f"  stack     {versions}",
            f"  devices   {gpus}",
            f"  storage   output_dir {'writable' if store['writable'] else 'NOT writable'}, {_size(store['free_bytes'])} "
            f"free" + (f"; {inputs}" if inputs else ""),
            f"  network   {net['backend']} on {net['interface'] or '?'} ({net['address'] or '?'}); /dev/shm "
            f"{_size(net['shm_bytes'])}; open files {net['open_files']}; memlock "
            f"{'unlimited' if net['memlock'] is None else net['memlock']}"
            + (f"; fabric {', '.join(net['fabric_devices'])}" if net["fabric_devices"] else ""),
        ]  # fmt: skip
    return lines


def collective_lines(reports: list[dict]) -> list[str]:
    rank0 = next((r for r in reports if r["rank"] == 0 and "collectives" in r), None)
    if rank0 is None:
        return ["collectives: one process, nothing to measure"]
    lines = ["collectives: all_reduce, all_gather, broadcast "
             + ("correct on every rank" if all(all(r["collectives"]["correct"].values()) for r in reports
                                                if "collectives" in r) else "WRONG on some rank (below)")]  # fmt: skip
    groups: dict[str, list[dict]] = {}
    for report in reports:
        for name, rows in report.get("collectives", {}).get("bandwidth", {}).items():
            groups.setdefault(name, rows)
    for name, rows in groups.items():
        shown = ", ".join(f"{row['bytes'] // 1024} KiB {_rate(row['busbw'])}" if row["bytes"] < 1 << 20
                          else f"{row['bytes'] >> 20} MiB {_rate(row['busbw'])}" for row in rows)  # fmt: skip
        lines.append(f"  all_reduce bus bandwidth ({name}): {shown}")
    if "ring" not in rank0["collectives"]:  # the preflight's quick check measures no bandwidth
        return lines
    links = [f"{r['collectives']['ring']['from_rank']}->{r['rank']} {r['collectives']['ring']['seconds'] * 1e3:.1f} ms"
             for r in sorted(reports, key=lambda r: r["rank"]) if "collectives" in r]  # fmt: skip
    lines.append(f"  ring links ({rank0['collectives']['ring']['bytes'] >> 20} MiB each): {', '.join(links)}")
    return lines


def verdict_lines(problems: list[Problem], notes: list[str], seconds: float) -> list[str]:
    lines = [f"note: {note}" for note in notes]
    if problems:
        lines += [f"problem: {p.line()}" for p in problems]
        lines.append(f"doctor: {len(problems)} problem(s) found in {seconds:.0f} s; fix them before training")
    else:
        lines.append(f"doctor: healthy ({seconds:.0f} s); `llmtune train` with the same flags will find what it needs")
    return lines
