"""The kernel that runs a submitted notebook, in a box: it sees a scratch copy of the submission, no course.

`nbgrader autograde` and `python -m grader check` run the student's notebook (its %%writefile cells, its
%%torchrun demos). That kernel is the student's code, so it gets the grading ranks' kind of box
(`grader.box.sandbox.Sandbox` with `KERNEL_VIEW`): Python and its packages, `tpkit/` and `launch/`, and a
writable scratch copy of the folder nbgrader runs it in. No `source/`, `solutions/`, `submitted/`,
`autograded/`, gradebook, home or network: it talks to its client over Unix sockets (ZeroMQ's `ipc`
transport) in the scratch folder, in its own network namespace. Only the trusted process (nbgrader,
with `grader.autograde.plugin.TrustedChecks`) writes the gradebook; the kernel's outputs still reach the
notebook through the protocol, so the student's feedback keeps them.
"""
from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tempfile

from jupyter_client.manager import AsyncKernelManager

from grader.box.sandbox import KERNEL_VIEW, ROOT, Sandbox, clean_env, give_to


@contextlib.contextmanager
def grading_kernel_env():
    """While a submitted notebook runs for grading: the in-kernel check() stands down (the trusted checks
    grade) and the student's own %%torchrun demo cells are not run (a demo that hangs or crashes must not
    hold up or sink the grade; the ranks that grade are the trusted job's)."""
    keys = {"GRADER_DEFER_CHECKS": "1", "COURSE_GRADING": "1"}
    old = {k: os.environ.get(k) for k in keys}
    os.environ.update(keys)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _seed_font_list(mplconfigdir: str):
    """matplotlib's list of the machine's fonts, copied from this user's matplotlib cache: a box starts with an empty
    home, where the first plot would scan every font again (0.2-0.3 s of a lab's check). The list names font files
    under /usr and the packages, which the box sees at the same paths; nothing else."""
    cache = os.environ.get("MPLCONFIGDIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "matplotlib")
    os.makedirs(mplconfigdir, exist_ok=True)
    for path in glob.glob(os.path.join(cache, "fontlist-*.json")):
        shutil.copyfile(path, os.path.join(mplconfigdir, os.path.basename(path)))


class BoxedKernelManager(AsyncKernelManager):
    """An AsyncKernelManager whose kernel starts inside `Sandbox(view=KERNEL_VIEW)` (where bubblewrap exists;
    else as usual, with the sandbox's note in the log)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.scratch = tempfile.mkdtemp(prefix="grader-kernel-")
        self.workdir = os.path.join(self.scratch, "work")
        self.sockets = os.path.join(self.scratch, "ipc")
        os.makedirs(self.workdir)
        os.makedirs(self.sockets)
        self.transport = "ipc"                               # no TCP: the box has no network to the client
        self.ip = os.path.join(self.sockets, "kernel")       # sockets kernel-1, kernel-2, ... in the scratch folder
        self.connection_file = os.path.join(self.sockets, "connection.json")
        self.box: Sandbox | None = None
        self.box_env: dict | None = None

    def format_kernel_cmd(self, extra_arguments=None):
        cmd = super().format_kernel_cmd(extra_arguments)
        src = (self._launch_args.get("cwd") if isinstance(self._launch_args, dict) else None) or os.getcwd()
        if os.path.isdir(src):
            # the notebook's folder as the student handed it in (their files), never the folder itself
            shutil.copytree(src, self.workdir, dirs_exist_ok=True, symlinks=False,
                            ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
        home = os.path.join(self.scratch, "home")
        os.makedirs(home, exist_ok=True)
        _seed_font_list(os.path.join(home, ".matplotlib"))
        self.box = Sandbox(view=KERNEL_VIEW, writable=[self.scratch], chdir=self.workdir, setpriv=True).__enter__()
        if not self.box.prefix:
            self.log.warning("kernel not boxed: %s", "; ".join(self.box.notes))
            return cmd
        for dirpath, dirs, files in os.walk(self.scratch):
            for name in dirs + files:
                give_to(os.path.join(dirpath, name), self.box.uid)
        self.box_env = clean_env(os.environ, {"HOME": home, "IPYTHONDIR": os.path.join(home, ".ipython"),
                                              "MPLCONFIGDIR": os.path.join(home, ".matplotlib"), "PYTHONPATH": ROOT,
                                              "JUPYTER_RUNTIME_DIR": self.sockets})
        # the kernel's own stdout/stderr (ipykernel's banner, crashes) go to a log in the scratch folder:
        # what the student's cells print reaches the notebook through the protocol, not through these
        log = ["/bin/sh", "-c", 'exec "$@" >>"$0" 2>&1', os.path.join(self.scratch, "kernel.log")]
        return list(self.box.prefix) + log + cmd

    async def _async_launch_kernel(self, kernel_cmd: list[str], **kw) -> None:
        if self.box_env is not None:
            # the box (bubblewrap, and the kernel it starts) gets the allowlist as its whole environment. `independent`:
            # no JPY_PARENT_PID, the grader's pid, which the kernel cannot see from its pid namespace (it would exit);
            # the box dies with its parent anyway (--die-with-parent)
            kw.update(env=dict(self.box_env), independent=True)
        await super()._async_launch_kernel(kernel_cmd, **kw)

    async def _async_cleanup_resources(self, restart: bool = False) -> None:
        await super()._async_cleanup_resources(restart=restart)
        if not restart:
            if self.box is not None:
                self.box.__exit__(None, None, None)
            shutil.rmtree(self.scratch, ignore_errors=True)
