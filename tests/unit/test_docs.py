"""Docs checked like code: README.md, docs/**/*.md and benchmarks/README.md.

* Commands. Every fenced shell block (```bash, ```sh, ```shell, ```console) and every
  inline code span that starts with an invocation is parsed with shlex (line
  continuations, ``&&``, ``;``, pipes, ``VAR=value`` prefixes, ``[--optional ARG]``
  synopsis brackets). Only commands that run this repository's code are checked, by
  rule: ``seerctl`` (the ``[project.scripts]`` entry point), ``python SCRIPT.py`` and
  ``python -m seer.<module>`` (any interpreter called ``python*``: ``.venv/bin/python``,
  ``.venv-verl/bin/python``, ``python3``), and ``bash``/``sh`` running a ``.sh`` file.
  Other programs (pip, git, curl, ray, ``python -m pytest``'s own flags, ...) are not
  checked, except that every argument of a checked command that names a file under one
  of the repository's tracked folders must exist (so ``pytest tests/x.py`` is checked too).
  The flags a script accepts come from running it once per unique script with its
  argument parser intercepted (``_HELP_DRIVER``: the script runs as ``__main__`` with
  ``--help``, and its first ``parse_args`` prints every parser's options, subcommands
  included, instead of parsing): exactly what ``--help`` would list, for every
  subcommand at once, in one process per script. They run in parallel on threads.
* Links. Every relative link ``[text](path)`` / ``[text](path#anchor)`` resolves to a file
  or folder, and an anchor into a markdown file to one of its headings (GitHub's slugs).
  Sections cited by name, ``docs/x.md, "Section"`` or ``(x.md, "Section")``, resolve to a
  heading of that file or a bold lead-in (``**Section ...**`` opening a paragraph or a
  bullet), whose text starts with the cited name.
* Configuration. Every key in docs/configuration.md's tables exists in ``SeerConfig``
  (seer/config.py), every key of ``SeerConfig`` is documented there, and each documented
  default is the schema's default.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import msgspec
import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted({ROOT / "README.md", ROOT / "benchmarks" / "README.md", *(ROOT / "docs").rglob("*.md")})
SHELL_LANGS = {"bash", "sh", "shell", "console"}
SEPARATORS = {"|", "||", "&&", ";", "&"}
WRAPPERS = {"sudo", "env", "time", "nohup", "exec", "command"}
# Extensions of files a command reads (an output path, e.g. `--out x.png`, need not exist).
INPUT_SUFFIXES = {"", ".py", ".sh", ".toml", ".jsonl", ".json", ".md", ".txt"}
HELP_TIMEOUT_S = 120
MARK = "@@SEER-DOCS-ARGPARSE@@"


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# --------------------------------------------------------------------------- markdown


@dataclass
class Block:
    lang: str
    start: int  # 1-based line of the first content line
    lines: list[str]


@dataclass
class Page:
    path: Path
    blocks: list[Block]
    prose: str  # the file with fenced blocks blanked (line numbers preserved)


@cache
def page(path: Path) -> Page:
    lines = path.read_text(encoding="utf-8").split("\n")
    blocks: list[Block] = []
    prose = list(lines)
    fence: str | None = None
    for i, line in enumerate(lines):
        m = re.match(r"^\s*(```+|~~~+)\s*([\w+-]*)", line)
        if fence is None and m:
            fence = m.group(1)
            blocks.append(Block(m.group(2).lower(), i + 2, []))
            prose[i] = ""
        elif fence is not None:
            prose[i] = ""
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence = None
            else:
                blocks[-1].lines.append(line)
    return Page(path, blocks, "\n".join(prose))


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


# --------------------------------------------------------------------------- commands


@dataclass
class Command:
    where: str  # file:line
    text: str  # the logical line, as written
    argv: list[str]  # one simple command (no separators, no VAR= prefixes, no wrappers)


def logical_lines(block: Block) -> list[tuple[int, str]]:
    """(line number, text) of each command line: continuations joined, console prompts
    kept only ("$ cmd"; console lines without a prompt are output)."""
    out: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for k, raw in enumerate(block.lines):
        n = block.start + k
        line = raw.rstrip()
        if pending is None:
            if block.lang == "console":
                if not line.lstrip().startswith("$ "):
                    continue
                line = line.lstrip()[2:]
            pending = (n, "")
        start, acc = pending
        if line.endswith("\\"):
            pending = (start, acc + line[:-1] + " ")
            continue
        out.append((start, acc + line))
        pending = None
    if pending is not None:
        out.append(pending)
    return out


def split_commands(text: str) -> list[list[str]]:
    try:
        tokens = shlex.split(text, comments=True)
    except ValueError:  # an unbalanced quote in prose-like code: fall back to words
        tokens = text.split()
    commands: list[list[str]] = [[]]
    for tok in tokens:
        if tok in SEPARATORS:
            commands.append([])
            continue
        end = tok.endswith(";") and not tok.endswith("\\;")
        tok = tok.rstrip(";") if end else tok
        # `[--flag ARG]` synopsis brackets are not part of the command.
        tok = tok.lstrip("[").rstrip("]")
        if tok:
            commands[-1].append(tok)
        if end:
            commands.append([])
    simple = []
    for argv in commands:
        while argv and (re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]) or argv[0] in WRAPPERS):
            argv = argv[1:]
        if argv:
            simple.append(argv)
    return simple


def is_python(exe: str) -> bool:
    return re.fullmatch(r"python(\d+(\.\d+)?)?", Path(exe).name) is not None


def is_seerctl(exe: str) -> bool:
    return Path(exe).name == "seerctl"


def runs_this_repo(argv: list[str]) -> bool:
    exe = argv[0]
    return is_seerctl(exe) or is_python(exe) or (exe in ("bash", "sh") and len(argv) > 1)


INVOCATION = re.compile(
    r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*(?:\S*/)?(?:seerctl|python(?:\d+(?:\.\d+)?)?)(?:\s|$)"
)


@cache
def commands() -> list[Command]:
    found: list[Command] = []
    for path in DOCS:
        pg = page(path)
        for block in pg.blocks:
            if block.lang not in SHELL_LANGS:
                continue
            for n, text in logical_lines(block):
                for argv in split_commands(text):
                    if runs_this_repo(argv):
                        found.append(Command(f"{rel(path)}:{n}", text.strip(), argv))
        # Inline code spans (a span may wrap onto the next line, never across a blank one)
        # and 4-space indented code lines that start with an invocation.
        for m in re.finditer(r"(?<!`)`([^`]+?)`(?!`)", pg.prose):
            span = " ".join(m.group(1).split())
            if "\n\n" in m.group(1) or not INVOCATION.match(span):
                continue
            for argv in split_commands(span):
                if runs_this_repo(argv):
                    found.append(Command(f"{rel(path)}:{line_of(pg.prose, m.start())}", span, argv))
        for m in re.finditer(r"(?m)^ {4,}(\S.*)$", pg.prose):
            text = m.group(1)
            if INVOCATION.match(text):
                for argv in split_commands(text):
                    if runs_this_repo(argv):
                        found.append(Command(f"{rel(path)}:{line_of(pg.prose, m.start())}", text, argv))
    return found


@dataclass(frozen=True)
class Target:
    """What a command runs: a script path, a module, or the seerctl entry point."""

    kind: str  # "script" | "module" | "entry"
    name: str


@dataclass
class Resolved:
    target: Target | None  # None: not this repo's code (flags not checked)
    args: list[str] = field(default_factory=list)
    problem: str | None = None


@cache
def package_dirs() -> list[tuple[str, Path]]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dirs = pyproject["tool"]["setuptools"]["package-dir"]
    return sorted(((pkg, ROOT / d) for pkg, d in dirs.items()), key=lambda x: -len(x[0]))


def module_file(module: str) -> Path | None:
    """The file of one of this repository's modules (by pyproject's package-dir), else None."""
    for pkg, folder in package_dirs():
        if module == pkg or module.startswith(pkg + "."):
            rest = module[len(pkg) + 1 :].split(".") if module != pkg else []
            base = folder.joinpath(*rest)
            for candidate in (base.with_suffix(".py"), base / "__main__.py", base / "__init__.py"):
                if rest and candidate.is_file():
                    return candidate
            return (base / "__main__.py") if (base / "__main__.py").is_file() else None
    return None


def is_repo_module(module: str) -> bool:
    return any(module == pkg or module.startswith(pkg + ".") for pkg, _ in package_dirs())


@cache
def seerctl_entry() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["seerctl"]


def resolve(argv: list[str]) -> Resolved:
    exe, rest = argv[0], argv[1:]
    if is_seerctl(exe):
        return Resolved(Target("entry", seerctl_entry()), rest)
    if exe in ("bash", "sh"):
        script = rest[0]
        if script.startswith("-") or not script.endswith(".sh"):
            return Resolved(None)
        if not (ROOT / script).is_file():
            return Resolved(None, rest, f"runs {script}, which does not exist")
        return Resolved(None, rest[1:])
    # python [interpreter options] (-m MODULE | -c CODE | SCRIPT) ARGS
    i = 0
    while i < len(rest):
        tok = rest[i]
        if tok == "-m" and i + 1 < len(rest):
            module, args = rest[i + 1], rest[i + 2 :]
            if not is_repo_module(module):
                return Resolved(None, args)  # pytest, venv, pip, verl ...: not this repo's
            if module_file(module) is None:
                return Resolved(None, args, f"`-m {module}`: no such module in this repository")
            return Resolved(Target("module", module), args)
        if tok == "-c":
            return Resolved(None)
        if tok in ("-X", "-W"):
            i += 2
            continue
        if tok.startswith("-"):
            i += 1
            continue
        script, args = tok, rest[i + 1 :]
        if any(c in script for c in "$<>*") or script.startswith(("/", "~")):
            return Resolved(None, args)  # a placeholder or a path outside the repository
        if not (ROOT / script).is_file():
            return Resolved(None, args, f"runs {script}, which does not exist")
        return Resolved(Target("script", script), args)
    return Resolved(None)  # a bare interpreter


@cache
def tracked_top_dirs() -> frozenset[str]:
    try:
        files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                               check=True, timeout=60).stdout.split()
    except (OSError, subprocess.SubprocessError):
        files = [f"{p.name}/x" for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return frozenset(f.split("/")[0] for f in files if "/" in f)


def missing_repo_paths(args: list[str]) -> list[str]:
    """Arguments naming an input file or folder under a tracked folder that does not exist."""
    out = []
    for arg in args:
        value = arg.split("=", 1)[1] if arg.startswith("--") and "=" in arg else arg
        value = value.split("::")[0]
        if "/" not in value or any(c in value for c in "$<>*{}~:") or value.startswith(("/", "-")):
            continue
        if value.split("/")[0] not in tracked_top_dirs():
            continue
        if Path(value).suffix not in INPUT_SUFFIXES:
            continue
        if not (ROOT / value).exists():
            out.append(value)
    return out


# --------------------------------------------------------------------------- --help

# Runs a script / module / entry point as `PROG --help` with argparse intercepted: the
# first parse_known_args prints the parser tree (options of every parser, subcommands
# included) as JSON and exits, so nothing past argument parsing ever runs.
_HELP_DRIVER = r"""
import argparse, json, os, runpy, sys, importlib
kind, name, mark = sys.argv[1], sys.argv[2], sys.argv[3]

def tree(parser):
    node = {"options": {}, "subcommands": {}}
    for action in parser._actions:
        for opt in action.option_strings:
            node["options"][opt] = action.nargs
        if isinstance(action, argparse._SubParsersAction):
            for sub, subparser in action.choices.items():
                node["subcommands"][sub] = tree(subparser)
    return node

def intercept(self, args=None, namespace=None):
    sys.stdout.write(mark + json.dumps(tree(self)) + "\n")
    sys.stdout.flush()
    os._exit(0)

argparse.ArgumentParser.parse_known_args = intercept
if kind == "script":
    sys.argv = [name, "--help"]
    sys.path.insert(0, os.path.dirname(os.path.abspath(name)))
    runpy.run_path(name, run_name="__main__")
elif kind == "module":
    sys.argv = [name, "--help"]
    runpy.run_module(name, run_name="__main__", alter_sys=True)
else:
    module, func = name.split(":")
    sys.argv = ["prog", "--help"]
    sys.exit(getattr(importlib.import_module(module), func)())
sys.stdout.write(mark + "null\n")
"""


def target_source(target: Target) -> Path:
    if target.kind == "script":
        return ROOT / target.name
    module = target.name.split(":")[0]
    path = module_file(module)
    assert path is not None, module
    return path


def static_tree(target: Target) -> dict:
    """Fallback when the script cannot run: every '--flag' string literal in its source."""
    flags = set(re.findall(r"""["'](--[A-Za-z0-9][\w-]*)["']""", target_source(target).read_text()))
    return {"options": {f: None for f in flags | {"--help"}}, "subcommands": {}, "static": True}


def parser_tree(target: Target) -> dict | str:
    """The target's parser tree, or a string saying why there is none."""
    if "argparse" not in target_source(target).read_text():
        return f"{target.name} does not use argparse, so its flags cannot be checked"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _HELP_DRIVER, target.kind, target.name, MARK],
            cwd=ROOT, capture_output=True, text=True, timeout=HELP_TIMEOUT_S,
        )
        for line in proc.stdout.splitlines():
            if line.startswith(MARK):
                found = json.loads(line[len(MARK):])
                if found is not None:
                    return found
        why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    except subprocess.TimeoutExpired:
        why = f"--help took over {HELP_TIMEOUT_S} s"
    # The script does not start (another change broke its imports): the flags in its
    # source still say what it accepts; the crash is for its own tests to report.
    warnings.warn(f"{target.name} --help failed ({why}); checking flags against its source")
    return static_tree(target)


@cache
def parser_trees() -> dict[Target, dict | str]:
    targets: set[Target] = set()
    for c in commands():
        r = resolve(c.argv)
        if r.target is not None and (r.args or r.target.kind == "entry"):
            targets.add(r.target)
    with ThreadPoolExecutor(max_workers=4) as pool:
        ordered = sorted(targets, key=lambda t: (t.kind, t.name))
        return dict(zip(ordered, pool.map(parser_tree, ordered)))


def flag_problems(tree: dict, args: list[str]) -> list[str]:
    problems: list[str] = []
    node, path = tree, []
    skip = 0
    for arg in args:
        if skip:
            skip -= 1
            if not arg.startswith("-"):
                continue
        if arg.startswith("--") and len(arg) > 2:
            flag = arg.split("=", 1)[0]
            if flag not in node["options"]:
                where = " ".join(path) or "the top level"
                problems.append(f"`{flag}` is not an option of {where}")
            elif "=" not in arg and node["options"][flag] not in (0, "?", "*", "+"):
                skip = 1 if node["options"][flag] is None else int(node["options"][flag])
            continue
        if arg.startswith("-"):
            continue  # short flags are not checked
        if node["subcommands"]:
            if arg not in node["subcommands"]:
                if re.fullmatch(r"[a-z][a-z0-9-]*", arg):
                    problems.append(f"`{arg}` is not a subcommand (there: {', '.join(node['subcommands'])})")
                break
            path.append(arg)
            node = node["subcommands"][arg]
    return problems


# --------------------------------------------------------------------------- links


def slug(heading: str) -> str:
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links -> their text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def headings(path: Path) -> list[str]:
    return [m.group(1).strip().rstrip("#").strip()
            for m in re.finditer(r"(?m)^#{1,6}\s+(.+)$", page(path).prose)]


@cache
def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for h in headings(path):
        s = slug(h)
        n = seen.get(s, 0)
        out.add(s if n == 0 else f"{s}-{n}")
        seen[s] = n + 1
    return out


@cache
def section_names(path: Path) -> list[str]:
    """Headings and bold lead-ins of paragraphs and bullets, normalised for comparison."""
    names = list(headings(path))
    names += re.findall(r"(?m)^\s*(?:[*-]\s+)?\*\*([^*]+)\*\*", page(path).prose)
    return [norm(n) for n in names]


def norm(text: str) -> str:
    return " ".join(text.replace("`", "").replace("*", "").lower().split())


def links(path: Path) -> list[tuple[int, str]]:
    pg = page(path)
    prose = re.sub(r"(?<!`)`[^`]+`(?!`)", lambda m: " " * len(m.group(0)), pg.prose)
    out = []
    for m in re.finditer(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose):
        out.append((line_of(prose, m.start()), m.group(1)))
    return out


CITATION = re.compile(
    r"(?P<file>(?:\.\./)*(?:[\w-]+/)*[\w.-]+\.md)\]?(?:\([^)]*\))?\)?,?\s+(?:section\s+)?\"(?P<sec>[^\"]{1,100})\""
)


def citations(path: Path) -> list[tuple[int, Path, str]]:
    pg = page(path)
    out = []
    for m in CITATION.finditer(pg.prose):
        name = m.group("file")
        base = ROOT if name.startswith(("docs/", "benchmarks/")) else path.parent
        target = (base / name).resolve()
        if not target.is_file() and (ROOT / "docs" / name).is_file():
            target = ROOT / "docs" / name
        out.append((line_of(pg.prose, m.start()), target, " ".join(m.group("sec").split())))
    return out


# --------------------------------------------------------------------------- config


@cache
def documented_config() -> list[tuple[int, str, str, str | None]]:
    """(line, section, key, default cell) of every key row in docs/configuration.md."""
    path = ROOT / "docs" / "configuration.md"
    rows = []
    section = None
    for n, line in enumerate(page(path).prose.split("\n"), 1):
        m = re.match(r"^##\s+`\[(\w+)\]`", line)
        if m:
            section = m.group(1)
            continue
        if line.startswith("## "):
            section = None
        if section is None or not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        keys = re.findall(r"`([a-z_][a-z0-9_]*)`", cells[0])
        defaults = re.findall(r"`([^`]*)`", cells[1]) if len(cells) > 1 else []
        for i, key in enumerate(keys):
            rows.append((n, section, key, defaults[i] if len(defaults) == len(keys) else None))
    return rows


def schema() -> dict[str, dict[str, object]]:
    from seer.config import SeerConfig

    out: dict[str, dict[str, object]] = {}
    for section in msgspec.structs.fields(SeerConfig):
        struct = type(section.default)
        out[section.name] = {f.name: f.default for f in msgspec.structs.fields(struct)}
    return out


# --------------------------------------------------------------------------- tests


def test_the_docs_have_commands_to_check():
    """The command extractor finds the docs' commands (an empty harvest would pass vacuously)."""
    found = commands()
    scripts = {r.target.name for c in found if (r := resolve(c.argv)).target and r.target.kind == "script"}
    assert len(found) >= 40 and len(scripts) >= 8, (len(found), sorted(scripts))


def test_doc_commands_run_scripts_and_files_that_exist():
    """Every command of this repo in the docs runs a script/module that exists and names existing repo files."""
    problems = []
    for c in commands():
        r = resolve(c.argv)
        if r.problem:
            problems.append(f"{c.where}: `{c.text}`: {r.problem}")
        for missing in missing_repo_paths(r.args):
            problems.append(f"{c.where}: `{c.text}`: names {missing}, which does not exist")
    assert not problems, "\n" + "\n".join(problems)


def test_doc_commands_pass_only_flags_their_script_accepts():
    """Every `--flag` (and subcommand) a documented command passes is one its script's --help lists."""
    trees = parser_trees()
    problems = []
    for c in commands():
        r = resolve(c.argv)
        if r.target is None or r.problem:
            continue
        tree = trees.get(r.target)
        if tree is None:
            continue
        if isinstance(tree, str):
            if any(a.startswith("--") for a in r.args):
                problems.append(f"{c.where}: `{c.text}`: {tree}")
            continue
        for p in flag_problems(tree, r.args):
            problems.append(f"{c.where}: `{c.text}`: {p}")
    assert not problems, "\n" + "\n".join(problems)


def test_relative_links_resolve():
    """Every relative markdown link points at an existing file or folder, and its #anchor at a heading."""
    problems = []
    for path in DOCS:
        for n, target in links(path):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                problems.append(f"{rel(path)}:{n}: link to {target}: {file_part} does not exist")
                continue
            if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{rel(path)}:{n}: link to {target}: no heading #{anchor} in {rel(dest)}")
    assert not problems, "\n" + "\n".join(problems)


def test_sections_cited_by_name_exist():
    """A section cited as `page.md, "Name"` is a heading (or bold lead-in) of that page starting with Name."""
    problems = []
    for path in DOCS:
        for n, target, name in citations(path):
            if not target.is_file():
                problems.append(f"{rel(path)}:{n}: cites \"{name}\" in {target.name}, which does not exist")
                continue
            want = norm(name)
            if not any(s == want or s.startswith(want) for s in section_names(target)):
                problems.append(f"{rel(path)}:{n}: cites section \"{name}\" of {rel(target)}, which has none")
    assert not problems, "\n" + "\n".join(problems)


def test_every_documented_config_key_exists():
    """Every key in docs/configuration.md's tables is a field of its section in seer/config.py."""
    keys = schema()
    rows = documented_config()
    assert len(rows) > 50, f"docs/configuration.md: only {len(rows)} key rows found; has its format changed?"
    problems = [f"docs/configuration.md:{n}: `[{s}] {k}` is not in seer/config.py"
                + ("" if s in keys else f" (no section [{s}])")
                for n, s, k, _ in rows if k not in keys.get(s, {})]
    assert not problems, "\n" + "\n".join(problems)


def test_every_config_key_is_documented():
    """Every field of every seer.toml section in seer/config.py has a row in docs/configuration.md."""
    documented = {(s, k) for _, s, k, _ in documented_config()}
    problems = [f"docs/configuration.md: `[{s}] {k}` (seer/config.py) is not documented"
                for s, fields in schema().items() for k in fields if (s, k) not in documented]
    assert not problems, "\n" + "\n".join(problems)


def test_documented_config_defaults_match_the_schema():
    """Each default in docs/configuration.md equals the default in seer/config.py."""
    keys = schema()
    problems = []
    for n, s, k, cell in documented_config():
        if cell is None or k not in keys.get(s, {}):
            continue
        try:
            value = tomllib.loads(f"v = {cell}")["v"]
        except tomllib.TOMLDecodeError:
            problems.append(f"docs/configuration.md:{n}: `[{s}] {k}` default `{cell}` is not a TOML value")
            continue
        if value != keys[s][k]:
            problems.append(f"docs/configuration.md:{n}: `[{s}] {k}` default `{cell}`, "
                            f"seer/config.py says {keys[s][k]!r}")
    assert not problems, "\n" + "\n".join(problems)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
