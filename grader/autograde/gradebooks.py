"""Merge gradebooks graded apart (one per slice of a class) into one, with nbgrader's own API.

A large class is graded as independent slices (SLURM array tasks, `launch/slurm/grade_class.sbatch`),
each into its own gradebook, so that no two machines share a SQLite file. `merge` then copies every
slice's students and submissions (each grade and comment, the timestamp, late penalty) into the
course's gradebook, which nbgrader made from the same source notebooks.

    python -m grader merge-gradebooks gradebook.db slices/gradebook-*.db

Or every worker writes into one shared gradebook on a database server (nbgrader's `db_url`, e.g.
`postgresql+psycopg2://...`): no merge, and `claim` keeps two workers off the same student.
"""
from __future__ import annotations

import contextlib
import os
import sys
import warnings

from nbgrader.api import Gradebook, MissingEntry
from sqlalchemy.exc import SAWarning


def url(db: str) -> str:
    """A gradebook's SQLAlchemy URL: a database URL as given, a file path as SQLite."""
    return db if "://" in db else f"sqlite:///{os.path.abspath(db)}"


def alembic_on_path():
    """nbgrader's Gradebook shells out to `alembic`, which lives beside this interpreter (a venv not activated)."""
    bindir = os.path.dirname(sys.executable)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")


@contextlib.contextmanager
def gradebook(db: str):
    """nbgrader's Gradebook on a file or database URL, without its SQLAlchemy autoflush notices on the console."""
    alembic_on_path()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=SAWarning)
        with Gradebook(url(db)) as gb:
            yield gb


class Taken(RuntimeError):
    """Another worker is grading this student in the same shared gradebook."""


@contextlib.contextmanager
def claim(db_url: str, assignment: str, student: str):
    """Hold `student`'s `assignment` in a shared PostgreSQL gradebook while it is graded: a session advisory
    lock, released when this connection closes (a killed worker's too). nbgrader's own writes would
    interleave two workers' grades of one student; a second worker gets `Taken` and writes nothing.
    A SQLite gradebook belongs to one machine's driver, which never grades a student twice: no lock."""
    if not db_url.startswith("postgresql"):
        yield
        return
    import hashlib
    import socket
    from sqlalchemy import create_engine, text
    key = int.from_bytes(hashlib.sha256(f"{assignment}/{student}".encode()).digest()[:8], "big", signed=True)
    me = f"grader {socket.gethostname()} pid {os.getpid()}"
    # autocommit: the session lock needs no transaction, and an idle-in-transaction session for the whole
    # grading would hold back the server's vacuum
    engine = create_engine(db_url, isolation_level="AUTOCOMMIT", connect_args={"application_name": me})
    try:
        with engine.connect() as conn:
            if not conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": key}).scalar():
                holder = conn.execute(text(
                    "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
                    "WHERE l.locktype = 'advisory' AND l.granted AND l.classid = :hi AND l.objid = :lo"),
                    {"hi": (key >> 32) & 0xFFFFFFFF, "lo": key & 0xFFFFFFFF}).scalar()
                raise Taken(f"{student}'s {assignment} is being graded by another worker ({holder or 'unknown'}) "
                            "in the same gradebook: not graded here, its grades left as that worker writes them; "
                            "give each worker its own students (--slice K/N)")
            try:
                yield
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})
    finally:
        engine.dispose()


def new_slice(course_db: str, path: str):
    """A slice's own gradebook: the course's assignments and notebooks, no submissions."""
    import shutil
    if not os.path.exists(course_db):
        raise FileNotFoundError(f"{course_db}: the course has no gradebook yet: release the assignment first "
                                "(`nbgrader generate_assignment WEEK`)")
    shutil.copy(course_db, path)
    with gradebook(path) as gb:
        for assignment in gb.assignments:
            for sub in list(assignment.submissions):
                gb.remove_submission(assignment.name, sub.student.id)


def merge(target: str, slices: list[str]) -> int:
    """Copy every submission of `slices` into `target`; returns how many. A student graded in two slices is
    an error (a slice must own its students), never silently overwritten."""
    copied, seen = 0, {}
    with gradebook(target) as out:
        for path in slices:
            if not os.path.exists(path):
                raise FileNotFoundError(f"{path}: no such gradebook (give the slices' gradebook files)")
            with gradebook(path) as src:
                for assignment in src.assignments:
                    try:
                        out.find_assignment(assignment.name)
                    except MissingEntry:
                        raise ValueError(f"{path} grades assignment {assignment.name!r}, which {target} does not "
                                         f"know: run `nbgrader generate_assignment {assignment.name}` (or `python "
                                         "-m grader release`) for the course first") from None
                    for sub in assignment.submissions:
                        student = sub.student
                        key = (assignment.name, student.id)
                        if key in seen:
                            raise ValueError(f"{student.id} has a {assignment.name} submission in both {seen[key]} "
                                             f"and {path}: each student belongs to exactly one slice")
                        seen[key] = path
                        out.update_or_create_student(student.id, first_name=student.first_name,
                                                     last_name=student.last_name, email=student.email)
                        try:
                            out.remove_submission(assignment.name, student.id)
                        except MissingEntry:
                            pass
                        out.add_submission(assignment.name, student.id, timestamp=sub.timestamp)
                        for nb in sub.notebooks:
                            for grade in nb.grades:
                                g = out.find_grade(grade.name, nb.name, assignment.name, student.id)
                                g.auto_score, g.manual_score = grade.auto_score, grade.manual_score
                                g.extra_credit, g.needs_manual_grade = grade.extra_credit, grade.needs_manual_grade
                            for comment in nb.comments:
                                c = out.find_comment(comment.name, nb.name, assignment.name, student.id)
                                c.auto_comment, c.manual_comment = comment.auto_comment, comment.manual_comment
                            new_nb = out.find_submission_notebook(nb.name, assignment.name, student.id)
                            new_nb.late_submission_penalty = nb.late_submission_penalty
                        out.db.commit()
                        copied += 1
    return copied
