"""What an autograde leaves in the course: the gradebook's automatic scores and autograded/, kept in agreement,
and owned by the course's owner whoever ran it.

Agreement. nbgrader's Autograde (on --force, or a newer submission) first removes autograded/<student>/<week>/,
writes the sanitized copy there, runs it, stores each grade cell's score (SaveAutoGrades), then writes the graded
notebook. When a run fails, nbgrader removes that folder again but never touches the gradebook, so the previous
run's scores (or this run's, when the graded notebook could not be written) stood for a notebook that is gone;
a killed run left the never-executed sanitized copy beside the old scores. So every run first takes back the
notebook's automatic scores (`ResetAutoGrades`, one transaction): whatever stops it afterwards, the gradebook
says "not autograded" (no automatic score, flagged for manual grading), never an old score. And whoever sees a
run fail (the class grader, which also kills runs past their time) `discard`s what it left: no automatic score
and no autograded folder.

Ownership. The full sandbox needs root, so an instructor may grade as root one day and as themself the next.
A root run's folders under autograded/ were root's: the instructor's next run could neither replace a student's
folder nor add one (PermissionError). `CourseOwnsOutputs`: as root, the folders a run writes into (and a
gradebook file root made) are handed to the owner of the course root before anything is written there; the files
root then writes are root's but sit in the owner's folders, which is all a later run needs to replace them. Run
as anyone else, a folder it cannot write is an error that names its owner and the fix, before nbgrader fails on it.
"""
from __future__ import annotations

import os
import pwd
import shutil

from nbgrader.api import MissingEntry
from nbgrader.preprocessors import NbGraderPreprocessor

from grader.autograde.gradebooks import gradebook


def reset_auto_grades(db_url: str, assignment: str, student: str, notebooks: list[str] | None = None) -> None:
    """Take back the automatic scores and comments of `student`'s `assignment` (of `notebooks` only, if given) in one
    transaction: each grade then counts as not autograded and is flagged for manual grading, as nbgrader flags a
    grade without an automatic score. Scores a person gave (manual_score) stay."""
    with gradebook(db_url) as gb:
        try:
            submission = gb.find_submission(assignment, student)
        except MissingEntry:
            return          # never graded: nothing to take back
        for nb in submission.notebooks:
            if notebooks is None or nb.name in notebooks:
                for grade in nb.grades:
                    grade.auto_score, grade.needs_manual_grade = None, True
                for comment in nb.comments:
                    comment.auto_comment = None
        gb.db.commit()


def discard(coursedir, assignment: str, student: str) -> None:
    """Leave `student`'s `assignment` not autograded, after a failed or killed run: no automatic score, no
    autograded folder. The scores go first: stopped between the two, a stale folder stands beside no score,
    never a score beside a removed notebook."""
    reset_auto_grades(coursedir.db_url, assignment, student)
    shutil.rmtree(coursedir.format_path(coursedir.autograded_directory, student, assignment), ignore_errors=True)


def _converter(pp):
    """The nbgrader converter running preprocessor `pp` (its exporter's parent): it knows the course's folders."""
    parent = pp.parent
    while parent is not None and not hasattr(parent, "coursedir"):
        parent = parent.parent
    if parent is None:
        raise RuntimeError(f"{type(pp).__name__} runs only inside an nbgrader converter (autograde, generate_feedback)")
    return parent


class ResetAutoGrades(NbGraderPreprocessor):
    """First of autograde's sanitize steps: the notebook's old automatic scores are taken back before it runs."""

    def preprocess(self, nb, resources):
        info = resources["nbgrader"]
        reset_auto_grades(info["db_url"], info["assignment"], info["student"], [info["notebook"]])
        return nb, resources


def _user(uid: int) -> str:
    """The account's name, or its number where it has none (as chown takes either)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def folders_down_to(root: str, dest: str) -> list[str]:
    """The course root and every folder from it down to `dest` (which lies under it)."""
    rel = os.path.relpath(dest, root)
    if rel.startswith(os.pardir):
        return [dest]
    parts = [] if rel == os.curdir else rel.split(os.sep)
    return [os.path.join(root, *parts[:k]) for k in range(len(parts) + 1)]


def sqlite_file(db_url: str) -> str | None:
    return db_url[len("sqlite:///"):] if db_url.startswith("sqlite:///") else None


def give_to_course_owner(root: str, paths: list[str]) -> None:
    """As root, in a course someone else owns: each of `paths` that root owns becomes the course owner's."""
    st = os.stat(root)
    if os.geteuid() != 0 or st.st_uid == 0:
        return
    for path in paths:
        if os.path.lexists(path) and os.lstat(path).st_uid == 0:
            os.lchown(path, st.st_uid, st.st_gid)


def hand_to_course_owner(root: str, dest: str, db_url: str) -> None:
    """As root, in a course someone else owns: the folders down to `dest` (made now, so none is root's), all
    already in `dest`, and the gradebook file become the course owner's, those that root made."""
    if os.geteuid() != 0 or os.stat(root).st_uid == 0:
        return
    os.makedirs(dest, exist_ok=True)
    inside = [os.path.join(d, n) for d, dirs, files in os.walk(dest) for n in dirs + files]
    give_to_course_owner(root, folders_down_to(root, dest) + inside + [p for p in [sqlite_file(db_url)] if p])


def fail_unless_writable(paths: list[str], root: str) -> None:
    """Every existing path of `paths` is writable by this user, or a PermissionError names the first that is not,
    its owner and the fix (such a path is what a run as another user left, or a root run without this module)."""
    for path in paths:
        if os.path.exists(path) and not os.access(path, os.W_OK | (os.X_OK if os.path.isdir(path) else 0)):
            owner, me = _user(os.stat(path).st_uid), _user(os.geteuid())
            raise PermissionError(
                f"{path} belongs to {owner}, and you ({me}) cannot write it, so nbgrader cannot replace what is "
                f"there: a run as {owner} made it. Give it back once (`sudo chown -R {me}: {path}`) or run as "
                f"{owner} again; root's autograde and generate_feedback runs hand what they make to the course "
                f"root's owner ({_user(os.stat(root).st_uid)}).")


class CourseOwnsOutputs(NbGraderPreprocessor):
    """Before a converter (autograde, generate_feedback) writes a student's folder: as root, the folders it writes
    into are the course owner's; as anyone else, writable by them, or an error naming the fix."""

    def preprocess(self, nb, resources):
        converter = _converter(self)
        info = resources["nbgrader"]
        root = converter.coursedir.root
        dest = converter._format_dest(info["assignment"], info["student"])
        if os.geteuid() == 0:
            hand_to_course_owner(root, dest, info["db_url"])
        else:
            fail_unless_writable(folders_down_to(root, dest), root)
        return nb, resources


def fail_unless_regradable(coursedir, assignment: str, students: list[str]) -> None:
    """What autograding `students` will replace, writable by this user (root may write anything): the gradebook
    file, and each student's autograded folder with the folders above and inside it. Checked before any run,
    because nbgrader removes a student's old folder before any preprocessor of ours runs."""
    if os.geteuid() == 0:
        return
    root = coursedir.root
    paths = [p for p in [sqlite_file(coursedir.db_url)] if p]
    for student in students:
        dest = coursedir.format_path(coursedir.autograded_directory, student, assignment)
        paths += folders_down_to(root, dest) + [d for d, _, _ in os.walk(dest)]
    fail_unless_writable(paths, root)
