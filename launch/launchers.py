"""The three ways ranks start, behind one interface: `spawn` starts the job, `outcome` reads how it ended.

- fork: `python -m launch.forkrun` imports torch once and forks N ranks (CPU/gloo; grading runs it in its box);
- warm: a resident launcher (launch/zygote.py) that has imported torch already forks each job (a notebook);
- torchrun: `torch.distributed.run`, a fresh interpreter per rank (GPUs: CUDA does not survive a fork).
All three give the ranks torchrun's environment; `launch.runner.Launch` relays and stops every one the same way.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field


@dataclass
class Outcome:
    exitcodes: dict[int, int] = field(default_factory=dict)   # rank -> exit status (negative: its signal)
    first_failure: int | None = None
    order: list[int] = field(default_factory=list)             # ranks in the order their processes ended
    timed_out: bool = False                                    # the launcher stopped the ranks at its deadline
    returncode: int | None = None                              # where the launcher's own status says it


class ForkLauncher:
    name = "fork"

    def command(self, target: str, module: bool, args, nproc: int | None, preload) -> list[str]:
        cmd = [sys.executable, "-m", "launch.forkrun"] + (["--hold"] if nproc is None else ["--nproc", str(nproc)])
        if preload:
            cmd += ["--preload", ",".join(preload)]
        return cmd + (["-m", target] if module else [target]) + list(args)

    def spawn(self, target, module, args, nproc, preload, wrap, env, cwd):
        cmd = [*wrap, *self.command(target, module, args, nproc, preload)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.PIPE if nproc is None else subprocess.DEVNULL,
                                env=env, cwd=cwd, start_new_session=True)
        return proc, cmd

    def outcome(self, proc, relay, nproc: int) -> Outcome:
        s = relay.status          # the launcher's closing "@@status {...}" line
        if not s:
            return Outcome()
        return Outcome(exitcodes={int(k): v for k, v in s["exitcodes"].items()}, first_failure=s["first_failure"],
                       order=[int(r) for r in s.get("order", [])], timed_out=bool(s.get("timed_out")))


class WarmLauncher(ForkLauncher):
    name = "warm"

    def spawn(self, target, module, args, nproc, preload, wrap, env, cwd):
        if wrap:
            raise ValueError("the warm launcher cannot run inside a wrapper (sandbox): use launcher='fork'")
        proc = WarmJob({"nproc": nproc, "target": target, "module": module, "args": list(args), "env": env,
                        "cwd": os.path.abspath(cwd or os.getcwd()), "preload": list(preload)})
        return proc, ["<warm>", target, *args]

    def outcome(self, proc, relay, nproc: int) -> Outcome:
        out = super().outcome(proc, relay, nproc)
        # the job's leader is not our child: its status line is the only word on how it ended
        out.returncode = 0 if relay.status and relay.status.get("first_failure") is None else 1
        return out


class TorchrunLauncher:
    name = "torchrun"

    def spawn(self, target, module, args, nproc, preload, wrap, env, cwd):
        cmd = [*wrap, sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts", "0",
               "--nproc-per-node", str(nproc), "--tee", "3"] + (["-m", target] if module else [target]) + list(args)
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, cwd=cwd, start_new_session=True), cmd

    def outcome(self, proc, relay, nproc: int) -> Outcome:
        """torchrun's agent reports failed ranks in its error summary ("rank : 1 ... exitcode : -11")."""
        out = Outcome(exitcodes={r: 0 for r in range(nproc)} if proc.returncode == 0 else {})
        text = "\n".join(relay.lines)
        for m in re.finditer(r"rank\s*:\s*(\d+).*?\n\s*exitcode\s*:\s*(-?\d+)", text):
            out.exitcodes[int(m.group(1))] = int(m.group(2))
        rc = re.search(r"Root Cause.*?rank\s*:\s*(\d+)", text, re.S)
        out.first_failure = int(rc.group(1)) if rc else None
        return out


LAUNCHERS = {"fork": ForkLauncher(), "warm": WarmLauncher(), "torchrun": TorchrunLauncher()}


class WarmJob:
    """A job forked by the warm launcher, with the bits of Popen that `Launch` uses."""

    def __init__(self, req: dict):
        from launch.zygote import start_job
        r, w = os.pipe()
        try:
            self.pid = start_job(req, w)
        finally:
            os.close(w)
        self.stdout = os.fdopen(r, "rb")
        self.returncode = None

    def poll(self):
        try:
            os.kill(self.pid, 0)
            with open(f"/proc/{self.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    raise ProcessLookupError
            return None
        except (ProcessLookupError, OSError):
            self.returncode = self.returncode if self.returncode is not None else 0
            return self.returncode

    def wait(self, timeout=None):
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("<warm job>", timeout)
            time.sleep(0.02)
        return self.returncode
