"""Sphinx glue for the course site: each page lists each script once.

sphinx-thebe adds its `const THEBE_JS_URL = ...` script on every `env-before-read-docs`; when
jupyter-book reads twice the page declares the constant twice and the browser reports
"Identifier 'THEBE_JS_URL' has already been declared". Drop the repeats per page.
"""


def _dedupe_scripts(app, pagename, templatename, context, doctree):
    seen, unique = set(), []
    for js in context.get("script_files", []):
        # the same inline script may come once with filename None and once with '': compare what is written
        key = (str(getattr(js, "filename", js) or ""), repr(sorted(getattr(js, "attributes", {}).items())))
        if key not in seen:
            seen.add(key)
            unique.append(js)
    if "script_files" in context:
        context["script_files"][:] = unique  # early: a later handler may end the event


def setup(app):
    app.connect("html-page-context", _dedupe_scripts, priority=10)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
