"""Commands of `python -m grader` that are not grading itself: a student's `check` of a notebook (cli_check.py; a
lab's later checks go to the warm trusted process of check_server.py), the benchmark, the demo class, lecture
execution, the bad-submission corpus builder and the GPU-node check."""
