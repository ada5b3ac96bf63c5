"""The judging core, run by the trusted process only: a `Case` (case.py) is what a check builds and expects;
job.py builds a job from cases, runs its launches (attempt.py: one launch in its box) and judges what the ranks
wrote against the single-device references (compare.py) within nested time limits (timeouts.py)."""
