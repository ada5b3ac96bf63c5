"""`check("week02/column_parallel")` in a lab notebook: a self-check of your modules on N ranks.

It runs in your kernel for fast feedback and grades nothing. Grades come from the trusted path
(`nbgrader autograde` with `grader.autograde.plugin.TrustedChecks`, or `python -m grader check`),
which rebuilds your modules from the notebook JSON and compares in its own process.
"""
from __future__ import annotations

import contextlib
import glob
import os
import warnings

from tpkit.course_imports import course_imports

MAX_MODULE_BYTES = 1_000_000


def kernel_sources(folder: str = ".") -> dict[str, str]:
    """{filename: text} of the modules your %%writefile cells left in `folder`."""
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.py"))):
        if os.path.getsize(path) <= MAX_MODULE_BYTES:
            with open(path) as f:
                out[os.path.basename(path)] = f.read()
    return out


SERVICE_ENV = "COURSE_GRADING_SERVICE"    # the socket of the class's trusted grading service (a student install)
MAX_REQUEST_BYTES = 4 << 20                # what the service accepts in one request
SERVICE_WAIT_S = 1900                      # a client waits this long for the service's next line
NO_GRADER = ("this is a student install of the course: it holds no grader, so checks are graded by the course's "
             "grading service, and {var} names none. Ask your instructor for the service's socket and set it, e.g. "
             "`export {var}=/run/tp-course/grading.sock` in a shell, or `%env {var}=/run/tp-course/grading.sock` in "
             "the notebook (on the course's JupyterHub it is set for you).")


class ServiceError(RuntimeError):
    """The grading service could not be reached, or refused the request."""


def has_grader() -> bool:
    """Whether this install holds the trusted grader (the full course root), not only the student side."""
    import importlib.util
    try:
        return importlib.util.find_spec("grader.judge") is not None
    except ImportError:
        return False


def service_address() -> str | None:
    return os.environ.get(SERVICE_ENV) or None


def ask_service(request: dict, write=None, wait: float = SERVICE_WAIT_S) -> tuple[int, str | None]:
    """Send `request` to the grading service and hand what it prints to `write(stream, text)` (default: print it);
    returns (exit status, score). Raises ServiceError where there is no service or it refuses the request."""
    import json
    import socket
    import sys
    where = service_address()
    if where is None:
        raise ServiceError(NO_GRADER.format(var=SERVICE_ENV))
    data = json.dumps(request).encode() + b"\n"
    if len(data) > MAX_REQUEST_BYTES:
        raise ServiceError(f"the request is {len(data) >> 20} MiB, over the grading service's "
                           f"{MAX_REQUEST_BYTES >> 20} MiB: is a module or an output that large?")
    if write is None:
        def write(to, text):
            stream = sys.stderr if to == 2 else sys.stdout
            stream.write(text)
            stream.flush()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(wait)
    try:
        conn.connect(where)
    except OSError as exc:
        conn.close()
        raise ServiceError(f"the grading service at {where} ({SERVICE_ENV}) does not answer ({exc.strerror or exc}): "
                           "is it running, and may your account reach its socket? Ask your instructor.") from None
    with conn:
        try:
            with contextlib.suppress(OSError):     # refused before it read the request: its answer says why
                conn.sendall(data)
            for line in conn.makefile("r", encoding="utf-8"):
                msg = json.loads(line)
                if "text" in msg:
                    write(msg.get("to"), msg["text"])
                elif "error" in msg:
                    raise ServiceError(f"the grading service answered: {msg['error']}")
                elif "exit" in msg:
                    return int(msg["exit"]), msg.get("score")
        except (OSError, ValueError, TypeError) as exc:
            raise ServiceError(f"the grading service at {where} stopped before it answered ({exc})") from None
    raise ServiceError(f"the grading service at {where} closed the connection before it answered")


def check_notebook_served(path: str, execute: bool = True) -> int:
    """`python -m grader check NOTEBOOK` in a student install: this process reads the notebook and sends its JSON to
    the grading service, which prints the verdicts and `score: X/Y`; the exit status as a local check's."""
    import json
    import sys
    try:
        with open(path, "rb") as f:
            nb = json.load(f)
    except (OSError, ValueError) as exc:
        print(f"error: {path} is not a readable notebook ({exc})")
        return 2
    try:
        code, _ = ask_service({"notebook": nb, "name": os.path.basename(path), "execute": execute})
    except ServiceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return code


def run_local(names, sources: dict[str, str], where: str | None = None, backend: str | None = None,
              launcher: str | None = None, sandbox: str = "off", interactive: bool = False) -> tuple[bool, str]:
    """Run the named checks on `sources` ({filename: text}) with the trusted grader in this process; (passed, the
    table or the failures' messages). Raises KeyError for an unknown check, AssertionError for a module that is
    missing or imports the course's own code. The grading service runs a kernel's `check()` with it."""
    from grader.judge.case import get_case
    from grader.judge.job import run_checks
    for n in names:
        get_case(n)  # unknown names fail before anything is launched
    module = get_case(names[0]).module
    if f"{module}.py" not in sources:
        raise AssertionError(f"{module}.py was not found in {where or os.getcwd()}: run the %%writefile {module}.py "
                             "cell above first.")
    used = [(f, line, m) for f, text in sources.items() for line, m in course_imports(text)]
    if used:
        f, line, m = used[0]
        raise AssertionError(f"{f} line {line} imports `{m}`: the course's own code is not there when your lab is "
                             "graded, so this would score 0. Write it yourself (the teaching library `tpkit` and "
                             "torch stay available).")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = run_checks(list(names), sources, backend=backend, launcher=launcher, sandbox=sandbox,
                            interactive=interactive)
    notes = [c.notes() for c in report.cases.values() if c.passed and c.notes()]
    if report.passed:
        return True, "\n".join([report.table()] + notes)
    failed = [c.message() for c in report.cases.values() if not c.passed] + notes
    return False, "\n".join(failed) + f"\n({report.seconds:.1f} s)"


def check(*names: str, backend: str | None = None, launcher: str | None = None) -> None:
    """Run the named checks on this folder's modules (what your %%writefile cells wrote).

    Prints one table when everything matches the single-device reference; raises
    AssertionError naming the rank, tensor and cause otherwise. Prints nothing on stderr.
    In a student install (no grader here), the modules go to the grading service COURSE_GRADING_SERVICE names.
    """
    __tracebackhide__ = True  # noqa: F841  (IPython hides this frame)
    if not names:
        raise ValueError('name the check to run, e.g. check("week02/column_parallel")')
    if os.environ.get("GRADER_DEFER_CHECKS") == "1":
        print(f"{', '.join(names)}: deferred to the trusted grader")
        return
    if service_address() is not None or not has_grader():
        _check_served(names)
        return
    try:
        # your own kernel, your own code: no sandbox unless GRADER_SANDBOX asks for one
        passed, text = run_local(names, kernel_sources(), backend=backend, launcher=launcher,
                                 sandbox=os.environ.get("GRADER_SANDBOX", "off"), interactive=True)
    except AssertionError as exc:
        raise AssertionError(str(exc)) from None
    if not passed:
        raise AssertionError(text) from None
    print(text)


def _check_served(names) -> None:
    """check(...) through the grading service: the kernel's modules go there, its answer comes back."""
    __tracebackhide__ = True  # noqa: F841
    said = []
    try:
        code, _ = ask_service({"checks": list(names), "modules": kernel_sources()},
                              write=lambda to, text: said.append(text))
    except ServiceError as exc:
        raise RuntimeError(str(exc)) from None
    text = "".join(said).rstrip("\n")
    if code == 0:
        print(text)
        return
    if text.startswith("error: "):
        text = text[len("error: "):]
    raise AssertionError(text) from None
