"""Commands of `python -m grader` that are not grading itself: a student's `check` of a notebook (cli_check.py),
the benchmark, the demo class, lecture execution, the bad-submission corpus builder and the GPU-node check."""
