"""What a grading rank runs: the rank entry and, per week, what each rank does with the student's module.

This subpackage (with `grader/__init__.py`, `launch/` and the teaching library `tpkit/`) is all of the
course a sandboxed grading rank can see. Cases, references, the comparison and the lecture reference
implementations stay in the trusted process. Nothing here may import them.
"""
