"""How values get into exported files: shell words for commands and scripts, YAML by a serializer.

Shell (torchrun and accelerate commands, the sbatch script): every value is one literal word,
quoted with shlex.quote, so the shell reads back exactly the characters given: `$(cmd)`,
backticks, `;`, `&&`, quotes, spaces, `*` and `~` are text, never syntax. The one exception, on
purpose: a value that is exactly one variable reference, `$NAME` or `${NAME}` (NAME a shell
identifier), is written double-quoted ("$NAME"), so the shell on the node expands it, as one
word; that is how `--master-addr $MASTER_ADDR` or `--env DATA='${SCRATCH}'` are meant. A value
that merely contains a `$` (`a$HOME`, `$HOME/data`, `${X:-y}`, `$1`) is literal. Control
characters never reach this module: checks.py refuses them.

A word is a str (one value), a `Ref` (a variable the exporter itself means, e.g. ${NODE_RANK}),
or a tuple of those, concatenated into one word: ("--rdzv-endpoint=", value(addr), ":29400").

YAML: documents are dumped by PyYAML's SafeDumper (multi-line strings as `|` blocks), never
assembled from text. Kubernetes expands `$(VAR)` in a container's env values and doubles `$$`
to `$`; k8s_literal() doubles every `$`, so the container sees the value as given.
"""
from __future__ import annotations

import shlex
from typing import Iterable, Union

import yaml

from .checks import is_var_ref


class Ref(str):
    """A shell variable reference ("$NAME" or "${NAME}") that the node's shell expands."""


Word = Union[str, tuple]


def value(v: str) -> str:
    """A user's value as a word part: a Ref if it is exactly `$NAME` / `${NAME}`, else literal."""
    return Ref(v) if is_var_ref(v) else v


def _part(p: str) -> str:
    if isinstance(p, Ref):
        if not is_var_ref(p):
            raise ValueError(f"shell reference {str(p)!r} is not '$NAME' or '${{NAME}}'")
        return f'"{p}"'
    return shlex.quote(p) if p else ""


def shell_word(word: Word) -> str:
    """One shell word that reads back as `word` (see the module docstring)."""
    parts = word if isinstance(word, tuple) else (word,)
    out = "".join(_part(p) for p in parts)
    return out or "''"


def shell_join(argv: Iterable[Word]) -> str:
    """A command line of shell_word()s: `shlex.split` of it gives the words back, references
    unexpanded."""
    return " ".join(shell_word(w) for w in argv)


def env_assignment(name: str, v: str) -> tuple:
    """`NAME=value` as one word the shell reads as an assignment (the name stays unquoted)."""
    return (f"{name}=", value(v))


def k8s_literal(v: str) -> str:
    """`v` for a Kubernetes env value or command: `$` doubled, so `$(X)` is not expanded."""
    return v.replace("$", "$$")


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, s: str):
    # a multi-line value (the config JSON) as a readable block; PyYAML falls back to a quoted
    # scalar by itself where a block cannot hold the text exactly
    return dumper.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)


_Dumper.add_representer(str, _str)
_Dumper.add_representer(Ref, _str)


def dump_yaml(header: str, *docs: dict) -> str:
    """`header` (comment lines from checked values) and the documents, by the YAML serializer."""
    body = yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, default_flow_style=False,
                         width=100, allow_unicode=True, explicit_start=len(docs) > 1)
    for line in header.splitlines():
        if not line.startswith("#"):
            raise ValueError(f"YAML header line {line!r} is not a comment")
    return header + body


__all__ = ["Ref", "value", "shell_word", "shell_join", "env_assignment", "k8s_literal",
           "dump_yaml"]
