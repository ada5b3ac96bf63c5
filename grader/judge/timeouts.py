"""A grading job's time limits. They nest: process group (PG_TIMEOUT) < job wall clock < + KILL_GRACE <
nbgrader's Execute.timeout (EXECUTE_TIMEOUT), so each limit reports before the one around it fires."""

PG_TIMEOUT = 10.0          # a collective on tiny tensors that waits this long is a hang
ITEM_TIMEOUT = 15          # one case on one rank (SIGALRM): Python-level loops and sleeps
STARTUP = 60.0             # launcher, imports and rendezvous, with slack for a loaded 2-core box
KILL_GRACE = 3.0
STOP_GRACE = 1.0           # ranks of a grading job finish together: one that left this much earlier died
EXECUTE_TIMEOUT = 900      # nbgrader per-cell limit; must exceed every job's wall clock + grace


def job_wall_clock(n_items: int, pg_timeout: float = PG_TIMEOUT, item_timeout: float = ITEM_TIMEOUT) -> float:
    # every item may burn one item timeout (a rank looping, its peers waiting for it)
    return STARTUP + max(pg_timeout, item_timeout) * (n_items + 1)
