"""The boxes student code runs in: a grading job's ranks (sandbox.py) and an autograded notebook's kernel
(kernel_box.py). Bubblewrap, an unprivileged uid, cgroups and resource limits; run by the trusted process."""
