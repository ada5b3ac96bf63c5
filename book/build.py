"""Build the self-study site: `python book/build.py` (what `make book` runs).

1. Discover what is present *now*: lecture notebooks `notebooks/week*.ipynb`, released labs
   `labs/week*/*.ipynb`, the notebooks of no week (`notebooks/cost_model_validation.ipynb`: an appendix), the guides
   `docs/student.md`, `docs/instructor.md`, and the bibliography `docs/sources.md`.
2. Stage them under build/book-src/ with the repository's relative layout, so the links the
   notebooks already use (`../labs/week02/tp_linear.ipynb`, `week01_x.ipynb#a-section`) resolve as
   they do on GitHub; a linked repository file that is not a page (`../tpkit/ledger.py`, a figure)
   is staged too and becomes a download link.
3. Write a page per week and _toc.yml from what was found, and a syllabus table into the intro.
4. Run jupyter-book (<2; nothing executes: `execute_notebooks: off`) inside a network namespace
   with no network when `unshare` allows it, so a build that tried to download a theme or an asset
   would fail here rather than quietly depend on the network.
5. Move the HTML to build/book/ and check every local link, image and #anchor in it.

Exit status 0 when the site was built and has no broken local link.
"""
from __future__ import annotations

import argparse
import glob
import html.parser
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GUIDES = [("docs/student.md", "Student guide"), ("docs/instructor.md", "Instructor guide"), ("docs/sources.md", "Sources")]
_WEEK = re.compile(r"week(\d+)")
_MD_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_SRC_ATTR = re.compile(r"""(?:src|href)\s*=\s*["']([^"']+)["']""")


# -- discovery ------------------------------------------------------------------
def week_of(path: str) -> int | None:
    m = _WEEK.search(os.path.basename(path)) or _WEEK.search(path)
    return int(m.group(1)) if m else None


def discover(root: str) -> dict[int, dict[str, list[str]]]:
    """{week: {"lectures": [relpath..], "labs": [relpath..]}} for the notebooks present under root."""
    weeks: dict[int, dict[str, list[str]]] = {}
    for p in sorted(glob.glob(os.path.join(root, "notebooks", "week*.ipynb"))):
        weeks.setdefault(week_of(p), {"lectures": [], "labs": []})["lectures"].append(os.path.relpath(p, root))
    for p in sorted(glob.glob(os.path.join(root, "labs", "week*", "*.ipynb"))):
        weeks.setdefault(week_of(os.path.dirname(p)), {"lectures": [], "labs": []})["labs"].append(
            os.path.relpath(p, root))
    weeks.pop(None, None)
    return dict(sorted(weeks.items()))


def appendices(root: str) -> list[str]:
    """The lecture notebooks of no week (relpaths): pages of their own, after the weeks."""
    return [os.path.relpath(p, root) for p in sorted(glob.glob(os.path.join(root, "notebooks", "*.ipynb")))
            if week_of(p) is None]


def notebook_title(path: str) -> str:
    """The first `# heading` of the notebook (markdown emphasis and code marks removed)."""
    try:
        with open(path) as f:
            nb = json.load(f)
    except (OSError, ValueError):
        return os.path.splitext(os.path.basename(path))[0]
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "markdown":
            continue
        src = cell.get("source", "")
        src = "".join(src) if isinstance(src, list) else src
        for line in src.splitlines():
            if line.startswith("# "):
                return re.sub(r"[*`]", "", line[2:]).strip()
    return os.path.splitext(os.path.basename(path))[0]


def _short(title: str, week: int) -> str:
    """'Week 2 lab: column- ...' -> 'column- ...' (the week page already says the week)."""
    return re.sub(rf"^week\s*0*{week}\b\s*(lab|lecture)?\s*[:.\-–—]\s*", "", title, flags=re.I) or title


# -- staging --------------------------------------------------------------------
def _linked_paths(text: str) -> list[str]:
    out = []
    for target in _MD_LINK.findall(text) + _SRC_ATTR.findall(text):
        if re.match(r"^[a-z][a-z0-9+.\-]*:", target, re.I) or target.startswith(("#", "/")):
            continue
        out.append(urllib.parse.unquote(target.split("#")[0].split("?")[0]))
    return [t for t in out if t]


def _text_of(path: str) -> str:
    if path.endswith(".ipynb"):
        with open(path) as f:
            nb = json.load(f)
        parts = []
        for c in nb.get("cells", []):
            if c.get("cell_type") == "markdown":
                s = c.get("source", "")
                parts.append("".join(s) if isinstance(s, list) else s)
        return "\n".join(parts)
    with open(path) as f:
        return f.read()


def stage_linked_files(root: str, src: str, pages: list[str]) -> list[str]:
    """Copy repository files that the pages link to (figures, .py files) into the staging tree."""
    copied = []
    for page in pages:
        base = os.path.dirname(os.path.join(root, page))
        for target in _linked_paths(_text_of(os.path.join(root, page))):
            full = os.path.normpath(os.path.join(base, target))
            rel = os.path.relpath(full, root)
            if rel.startswith("..") or not os.path.isfile(full) or full.endswith((".ipynb", ".md")):
                continue  # outside the repo, missing (reported after the build), or a page
            dest = os.path.join(src, rel)
            if not os.path.exists(dest):
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                shutil.copy2(full, dest)
                copied.append(rel)
    return copied


def copy_mathjax(src: str) -> bool:
    """MathJax 3's single-file TeX->SVG bundle (django-static-mathjax wheel: MathJax 3.2.2) into the site."""
    try:
        import mathjax
    except ImportError:
        return False
    bundle = os.path.join(os.path.dirname(mathjax.__file__), "static", "mathjax", "es5", "tex-svg-full.js")
    if not os.path.exists(bundle):
        return False
    dest = os.path.join(src, "_mathjax", "mathjax")  # html_static_path: served as _static/mathjax/
    os.makedirs(dest, exist_ok=True)
    shutil.copy2(bundle, dest)
    return True


def week_page(week: int, entry: dict, titles: dict[str, str]) -> str:
    lec, labs = entry["lectures"], entry["labs"]
    head = _short(titles[lec[0]], week) if lec else (_short(titles[labs[0]], week) if labs else "")
    lines = [f"# Week {week}: {head}" if head else f"# Week {week}", ""]
    for p in lec:
        lines.append(f"- **Lecture:** [{titles[p]}](../{p})")
    for p in labs:
        lines.append(f"- **Lab:** [{titles[p]}](../{p})")
    if not lec:
        lines.append("- The lecture for this week is not written yet.")
    if not labs:
        lines.append("- The lab for this week is not released yet.")
    if labs:
        lines += ["", "Work the lab in JupyterLab (`make lab` in a clone of the repository), then grade it the way "
                  "the course does:", "", "```bash"]
        lines += [f"python -m grader check {p}" for p in labs]
        lines += ["```", "", "It prints one line per grade cell, the checks' table and `score: X/Y`; see the "
                  "student guide for what each message means." if os.path.exists(os.path.join(ROOT, GUIDES[0][0]))
                  else "It prints one line per grade cell, the checks' table and `score: X/Y`."]
    return "\n".join(lines) + "\n"


def syllabus(weeks: dict, titles: dict[str, str]) -> str:
    rows = ["| week | lecture | lab |", "|---|---|---|"]
    for w, e in weeks.items():
        lec = "<br>".join(f"[{_short(titles[p], w)}]({p})" for p in e["lectures"]) or "(not yet)"
        lab = "<br>".join(f"[{_short(titles[p], w)}]({p})" for p in e["labs"]) or "(not yet)"
        rows.append(f"| [Week {w}](weeks/week{w:02d}.md) | {lec} | {lab} |")
    return "\n".join(rows) + "\n"


def toc_yaml(weeks: dict, guides: list[str], titles: dict[str, str], extra: list[str] = ()) -> str:
    def noext(p):
        return os.path.splitext(p)[0]
    out = ["format: jb-book", "root: intro", "parts:", "  - caption: Weeks", "    chapters:"]
    for w, e in weeks.items():
        out.append(f"      - file: weeks/week{w:02d}")
        pages = [("Lecture", p) for p in e["lectures"]] + [("Lab", p) for p in e["labs"]]
        if pages:
            out.append("        sections:")
            for kind, p in pages:
                out += [f"          - file: {noext(p)}", f"            title: {json.dumps(kind + ': ' + _short(titles[p], w))}"]
    if extra:
        out += ["  - caption: Appendix", "    chapters:"]
        for p in extra:
            out += [f"      - file: {noext(p)}", f"        title: {json.dumps(titles[p])}"]
    if guides:
        out += ["  - caption: Guides", "    chapters:"] + [f"      - file: {noext(g)}" for g in guides]
    return "\n".join(out) + "\n"


def stage(root: str, src: str) -> dict:
    shutil.rmtree(src, ignore_errors=True)
    os.makedirs(src)
    weeks = discover(root)
    extra = appendices(root)
    pages = [p for e in weeks.values() for p in e["lectures"] + e["labs"]] + extra
    guides = [g for g, _ in GUIDES if os.path.exists(os.path.join(root, g))]
    for p in pages + guides:
        os.makedirs(os.path.dirname(os.path.join(src, p)), exist_ok=True)
        shutil.copy2(os.path.join(root, p), os.path.join(src, p))
    titles = {p: notebook_title(os.path.join(root, p)) for p in pages}
    for f in ("_config.yml", "favicon.svg"):
        shutil.copy2(os.path.join(HERE, f), os.path.join(src, f))
    shutil.copytree(os.path.join(HERE, "_ext"), os.path.join(src, "_ext"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    with open(os.path.join(HERE, "intro.md")) as f:
        intro = f.read().replace("<!-- SYLLABUS -->", syllabus(weeks, titles) if weeks else
                                 "No week is written yet.")
    with open(os.path.join(src, "intro.md"), "w") as f:
        f.write(intro)
    os.makedirs(os.path.join(src, "weeks"))
    for w, e in weeks.items():
        with open(os.path.join(src, "weeks", f"week{w:02d}.md"), "w") as f:
            f.write(week_page(w, e, titles))
    with open(os.path.join(src, "_toc.yml"), "w") as f:
        f.write(toc_yaml(weeks, guides, titles, extra))
    linked = stage_linked_files(root, src, pages + guides)
    mathjax = copy_mathjax(src)
    return {"weeks": weeks, "pages": pages, "guides": guides, "linked": linked, "mathjax": mathjax}


# -- build ----------------------------------------------------------------------
def _offline_prefix() -> list[str]:
    """`unshare --net` (a network namespace with no route out) when this machine allows it."""
    unshare = shutil.which("unshare")
    if not unshare:
        return []
    for prefix in ([unshare, "--net"], [unshare, "--net", "--map-root-user"]):
        try:
            if subprocess.run(prefix + ["true"], capture_output=True, timeout=10).returncode == 0:
                return prefix
        except (OSError, subprocess.TimeoutExpired):
            continue
    return []


def jupyter_book(src: str, log_path: str) -> tuple[int, bool]:
    exe = os.path.join(os.path.dirname(sys.executable), "jupyter-book")
    if not os.path.exists(exe):
        exe = shutil.which("jupyter-book") or exe
    prefix = _offline_prefix()
    cmd = prefix + [exe, "build", src, "--builder", "html"]
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=src).returncode
    return rc, bool(prefix)


class _Refs(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.refs: list[tuple[str, str]] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "a" and a.get("name"):
            self.ids.add(a["name"])
        for k in ("href", "src"):
            if a.get(k) and not (tag == "link" and a.get("rel") in ("preconnect", "dns-prefetch")):
                self.refs.append((tag, a[k]))


def check_site(out: str, root: str | None = None, pending: list[str] | None = None) -> list[str]:
    """Every local href/src in the built HTML points to a file that exists, and every #anchor to an id.

    A link to a notebook that is not in `root` yet (a week being written) is put in `pending`, not
    counted as broken: MyST renders such a link as a dead #anchor.
    """
    pending = [] if pending is None else pending
    parsed: dict[str, _Refs] = {}

    def parse(path):
        if path not in parsed:
            p = _Refs()
            with open(path, encoding="utf-8", errors="replace") as f:
                p.feed(f.read())
            parsed[path] = p
        return parsed[path]

    problems = []
    for page in sorted(glob.glob(os.path.join(out, "**", "*.html"), recursive=True)):
        if os.sep + "_static" + os.sep in page:
            continue
        for tag, ref in parse(page).refs:
            if re.match(r"^[a-z][a-z0-9+.\-]*:", ref, re.I) or ref.startswith("//"):
                continue  # external (http, mailto, data:) links are the reader's network's business
            path, _, frag = ref.partition("#")
            path = urllib.parse.unquote(path.split("?")[0])
            target = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            rel = os.path.relpath(page, out)
            if os.path.isdir(target):
                target = os.path.join(target, "index.html")
            if not os.path.exists(target):
                problems.append(f"{rel}: <{tag}> {ref} -> missing file")
            elif frag and target.endswith(".html") and urllib.parse.unquote(frag) not in parse(target).ids:
                frag = urllib.parse.unquote(frag)
                if frag.endswith((".ipynb", ".md")) and root and not os.path.exists(
                        os.path.normpath(os.path.join(root, os.path.dirname(rel), frag.split("#")[0]))):
                    pending.append(f"{rel}: links to {frag}, which is not in the repository yet")
                else:
                    problems.append(f"{rel}: <{tag}> {ref} -> no element with id {frag!r}")
    return problems


def warnings_of(log_path: str) -> list[str]:
    with open(log_path, errors="replace") as f:
        return [re.sub(r"\x1b\[[0-9;]*m", "", ln).rstrip() for ln in f if "WARNING" in ln or "ERROR" in ln]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=ROOT, help="repository to take the notebooks from (default: this one)")
    ap.add_argument("--out", default=os.path.join(ROOT, "build", "book"), help="where the HTML goes")
    ap.add_argument("--src", default=None, help="staging folder (default: OUT-src)")
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    out = os.path.abspath(a.out)
    src = os.path.abspath(a.src or out.rstrip(os.sep) + "-src")
    info = stage(os.path.abspath(a.root), src)
    nweeks = len(info["weeks"])
    print(f"book: {nweeks} week(s), {len(info['pages'])} notebook page(s), {len(info['guides'])} guide(s) "
          f"staged in {os.path.relpath(src)}; MathJax {'bundled' if info['mathjax'] else 'MISSING (math will not render offline)'}")
    log_path = src + ".log"
    rc, offline = jupyter_book(src, log_path)
    warns = warnings_of(log_path)
    for w in warns[:40]:
        print("  " + w)
    if rc != 0:
        print(f"book: jupyter-book failed (exit {rc}); full log: {log_path}")
        with open(log_path, errors="replace") as f:
            print("".join(f.readlines()[-30:]))
        return rc
    shutil.rmtree(out, ignore_errors=True)
    shutil.move(os.path.join(src, "_build", "html"), out)
    pending: list[str] = []
    problems = check_site(out, os.path.abspath(a.root), pending)
    for p in pending:
        print("  pending: " + p)
    for p in problems[:40]:
        print("  broken: " + p)
    print(f"book: built {os.path.relpath(out)}/index.html in {time.monotonic() - t0:.1f} s "
          f"({'offline: built under unshare --net' if offline else 'network not isolated (no unshare)'}; "
          f"{len(warns)} warning(s), {len(problems)} broken local link(s), {len(pending)} to pages not written yet; log {os.path.relpath(log_path)})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
