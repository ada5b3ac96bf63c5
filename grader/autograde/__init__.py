"""nbgrader integration, run by the instructor's process: the preprocessor that grades a notebook's grade cells
the trusted way (plugin.py, notebook.py), nbgrader's API for a course (nbgrader_tools.py), grading a class in
parallel workers (class_autograde.py) and the gradebooks they write (gradebooks.py)."""
