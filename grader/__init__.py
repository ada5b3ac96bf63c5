"""The course's trusted grader: cases with their single-device references, the job, the comparison,
the sandbox, the nbgrader plugin and the CLI (`python -m grader`).

Students never import it: their self-check is `tpkit.check`. A grading rank sees only this file and
`grader/rank/`; the notebook being autograded sees none of it.
"""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the course repository
