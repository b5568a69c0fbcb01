"""A benchmark scored by llama.cpp's own `llama-perplexity`, each task's verdict read back from what it prints.

llama-perplexity prints a line a task in the order it scores them (draw.py's order): for HellaSwag and the
multiple-choice format the running accuracy (`n<TAB>acc%...`), from which each task's verdict follows as the
change in the count right; for WinoGrande its two scores, its answer and the right one. The command is the one
a user would type (`-m FILE -f DATA --hellaswag --hellaswag-tasks N -c CTX -b BATCH -t THREADS`, `--lora`,
`-np` where a task has more than four answers), with `--no-repack` where mfgguf's policy says so (AMX CPUs).

Example:
    >>> right = llama_perplexity(Path("model.gguf"), "hellaswag", Path("hs.txt"), 400, ctx=512, batch=512, threads=2)
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Callable

from mfgguf.errors import MfggufError
from mfgguf.runtime.tools import need

FLAG = {"hellaswag": "--hellaswag", "winogrande": "--winogrande", "multiple-choice": "--multiple-choice"}
_RUNNING = re.compile(r"^(\d+)\t(\d+(?:\.\d+)?)%?(?:\t|$)")  # task number, running accuracy in percent
_WINO = re.compile(r"^(\d+)\t(\d+\.\d+)\t\s*(\S+)\s+(\S+)\s+([12])\s+([12])\s*$")  # n, acc, score 1, score 2, answer, right


def command(model: Path, benchmark: str, data: Path, n_tasks: int | None, *, ctx: int, batch: int, threads: int,
            n_parallel: int, lora: Path | None = None, overrides: dict | None = None) -> list[str]:
    from mfgguf.runtime import repack

    cmd = [str(need("llama-perplexity")), "-m", str(model), "-f", str(data), FLAG[benchmark],
           "-c", str(ctx), "-b", str(batch), "-t", str(threads)]
    if n_tasks is not None:
        cmd += [f"{FLAG[benchmark]}-tasks", str(n_tasks)]
    if n_parallel > 4:
        cmd += ["-np", str(n_parallel)]
    if lora is not None:
        cmd += ["--lora", str(lora)]
    for k, v in (overrides or {}).items():
        cmd += ["--override-kv", f"{k}=int:{int(v)}"]
    return cmd + ([] if repack.current().repack else ["--no-repack"])


def llama_perplexity(model: Path, benchmark: str, data: Path, n_tasks: int | None, *, ctx: int, batch: int,
                     threads: int, n_parallel: int = 4, lora: Path | None = None, expected: int,
                     progress: Callable[[int, int], None] | None = None, overrides: dict | None = None) -> list[int]:
    """Each scored task's verdict (1 right, 0 wrong) in llama-perplexity's order; `progress(done, right)` is called
    as its lines arrive. A run that ends well may still be short of `expected` at its end: llama.cpp's logger writes
    from a thread of its own, which the program does not wait for at exit (llama.cpp issue 22142), so its last lines
    are at times lost; the caller scores those tasks another way. A run that fails stops with one line."""
    import tempfile

    cmd = command(model, benchmark, data, n_tasks, ctx=ctx, batch=batch, threads=threads, n_parallel=n_parallel,
                  lora=lora, overrides=overrides)
    reader = Verdicts(benchmark)
    with tempfile.TemporaryFile("w+", errors="replace") as err:  # a file: a pipe nobody reads fills and blocks it
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, text=True,
                                errors="replace")
        try:
            for line in proc.stdout:
                if reader.read(line) and progress is not None:
                    progress(len(reader.right), sum(reader.right))
            rc = proc.wait()
        finally:
            if proc.poll() is None:  # Ctrl-C or an error here: the program does not outlive the verb
                proc.kill()
                proc.wait()
        err.seek(0)
        tail = " | ".join(err.read().strip().splitlines()[-3:])
    if rc != 0 or len(reader.right) > expected or not reader.right:
        raise MfggufError(f"llama-perplexity scored {len(reader.right)} of {expected} {benchmark} tasks (exit {rc}:"
                          f" {tail[-300:]}); run `{' '.join(cmd)}` to see why")
    return reader.right


class Verdicts:
    """The verdicts llama-perplexity's per-task lines hold, read a line at a time, in order."""

    def __init__(self, benchmark: str):
        self.benchmark, self.right, self._count = benchmark, [], 0
        self.scores: list[tuple[float, float]] = []  # WinoGrande: the two candidates' scores it prints

    def read(self, line: str) -> bool:
        """Take one line of its output; True where it was a task's."""
        line = line.rstrip("\n")
        if self.benchmark == "winogrande":
            m = _WINO.match(line)
            if not m or int(m.group(1)) != len(self.right) + 1:
                return False
            self.right.append(int(m.group(5) == m.group(6)))
            self.scores.append((float(m.group(3)), float(m.group(4))))
            return True
        m = _RUNNING.match(line)
        if not m or int(m.group(1)) != len(self.right) + 1:
            return False
        n = int(m.group(1))
        now = round(float(m.group(2)) * n / 100)  # tasks right so far
        self.right.append(now - self._count)
        self._count = now
        return True


def parse(benchmark: str, out: str) -> list[int]:
    """The verdicts in a whole output of llama-perplexity."""
    reader = Verdicts(benchmark)
    for line in out.splitlines():
        reader.read(line)
    return reader.right


__all__ = ["Verdicts", "command", "llama_perplexity", "parse"]
