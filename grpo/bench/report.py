"""The benches' output: a plain-text table, and the JSON report stamped with the machine it ran on."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile

from grpo.cpus import machine_info
from grpo.log import write_json
from grpo.scratch import own_tmpdir

KEPT: list[str] = []  # the temporary folder outside `scratch` (where a bench keeps what its report names)


@contextlib.contextmanager
def scratch():
    """One bench command's temporary files in one folder, removed at its end: its run folders (each with
    a checkpoint and an exported model: gigabytes on a real model), servers' URL files and logs, and what
    its children write to TMPDIR (vLLM's sockets and FileStore files, torchrun's). Before, every bench
    left them all in /tmp. torch's compile cache stays where it was (it is reused across runs); a bench
    that names a folder in its report makes it under `KEPT[0]`, outside."""
    KEPT[:] = [tempfile.gettempdir()]
    try:
        with own_tmpdir("grpo-bench-") as folder:
            yield folder
    finally:
        KEPT.clear()


def write_report(path: str, report: dict) -> None:
    """The bench's JSON, with the machine it ran on (CPU model, torch's kernel set, threads)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_json(path, {**report, "machine": machine_info()})  # strict JSON: a NaN as null (grpo/log.py)


def table(rows: list[dict], cols: list[str]) -> str:
    def fmt(v) -> str:
        if isinstance(v, float):
            return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"
        return str(v)

    widths = [max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in cols]
    lines = [" | ".join(c.ljust(w) for c, w in zip(cols, widths)), "-+-".join("-" * w for w in widths)]
    lines += [" | ".join(fmt(r.get(c, "")).ljust(w) for c, w in zip(cols, widths)) for r in rows]
    return "\n".join(lines)


def publish(out: str, report: dict, sections: list) -> None:
    """Every bench subcommand's output: each section printed (a line of text, or `(title, rows,
    columns)` as a table under its title), then the JSON report written to `out`."""
    for section in sections:
        if isinstance(section, str):
            print(section)
        else:
            title, rows, cols = section
            print(f"\n{title}\n{table(rows, cols)}")
    write_report(out, report)
    print(f"wrote {out}")


def ranks_json(module: str, ranks: int, args: list[str], out: str, what: str, env: dict | None = None):
    """`python -m module *args` on `ranks` processes (torchrun, standalone; one thread each unless `env`
    says otherwise), and the JSON its rank 0 wrote to `out`; a failure raises with `what` and the stderr's end."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks), "-m", module, *args]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    if res.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"{what} failed:\n{res.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)
