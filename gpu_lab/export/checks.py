"""What each JobSpec field accepts, checked before anything is exported.

Contract: every check either returns the value unchanged or raises ValueError naming the field,
the value (repr) and the rule. No check rewrites a value: an exported file holds exactly what was
asked, or nothing is exported.

- Every text field: no control characters (C0 such as newline, CR, tab and NUL; DEL; C1; the
  Unicode line and paragraph separators). They would end a line of a script, an #SBATCH
  directive or a YAML scalar, so they are refused everywhere, not escaped.
- Slurm: partition (a comma-separated list of names), account and qos are names of letters,
  digits, '_', '.' and '-'; the time limit is one of Slurm's formats (minutes, MM:SS, HH:MM:SS,
  D-HH, D-HH:MM, D-HH:MM:SS, UNLIMITED). Such values never need quoting in an #SBATCH line.
- Kubernetes: the job name and namespace are DNS-1123 labels, resource names (the runtime)
  DNS-1123 subdomains, environment variable names C identifiers (also shell names), the image a
  container image reference (registry/path:tag@digest grammar), /dev/shm a resource quantity.
- The rendezvous host is a host name, an IPv4 address, or exactly one `$VAR` / `${VAR}`
  reference that the node's shell expands.
"""
from __future__ import annotations

import re
import unicodedata

VAR_REF = re.compile(r"\$(?:[A-Za-z_][A-Za-z0-9_]*|\{[A-Za-z_][A-Za-z0-9_]*\})")
C_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
HOST = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?(\.[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?)*")
SLURM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
SLURM_TIME = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}|UNLIMITED|INFINITE",
                        re.ASCII)
QUANTITY = re.compile(r"\d+(\.\d+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?", re.ASCII)
# github.com/distribution/reference: [domain[:port]/]path[:tag][@digest]
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
IMAGE = re.compile(rf"(?:{_DOMAIN}(?::\d+)?/)?{_COMPONENT}(?:/{_COMPONENT})*"
                   r"(?::[\w][\w.-]{0,127})?(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*"
                   r":[0-9a-fA-F]{32,})?", re.ASCII)

MAX_NAME = 48  # the operators add '-worker-12'-style suffixes; pod names must stay <= 63


def is_var_ref(value: str) -> bool:
    """Whether `value` is exactly one shell variable reference, `$NAME` or `${NAME}`."""
    return isinstance(value, str) and VAR_REF.fullmatch(value) is not None


def _control(value: str) -> str | None:
    for ch in value:
        if unicodedata.category(ch) in ("Cc", "Zl", "Zp"):
            return ch
    return None


def text(field: str, value, allow_empty: bool = False) -> str:
    """A string without control characters (see the module docstring)."""
    if not isinstance(value, str):
        raise TypeError(f"{field}: got {value!r} ({type(value).__name__}); expected a string")
    ch = _control(value)
    if ch is not None:
        raise ValueError(f"{field}: got {value!r}, which holds the control character {ch!r}; "
                         "accepted: printable text on one line (newlines, tabs, carriage "
                         "returns, NUL and other control characters would split the exported "
                         "script or YAML)")
    if not value and not allow_empty:
        raise ValueError(f"{field}: got {value!r}; expected a value (it is empty)")
    return value


def pattern(field: str, value, rx: re.Pattern, rule: str, max_len: int | None = None) -> str:
    """`value` (checked by text()) matching `rx` whole and at most `max_len` characters."""
    text(field, value)
    # the length first: it also bounds the regex's work on a huge value
    if (max_len is not None and len(value) > max_len) or rx.fullmatch(value) is None:
        raise ValueError(f"{field}: got {value!r}; accepted: {rule}")
    return value


def dns_label(field: str, value, max_len: int = 63, hint: str = "") -> str:
    return pattern(field, value, DNS_LABEL,
                   f"a Kubernetes name (lower-case letters, digits and '-', starting and ending "
                   f"with a letter or digit, at most {max_len} characters){hint}", max_len)


def dns_subdomain(field: str, value, example: str) -> str:
    return pattern(field, value, DNS_SUBDOMAIN,
                   "a Kubernetes name (lower-case letters, digits, '-' and '.', each "
                   f"dot-separated part starting and ending with a letter or digit, at most 253 "
                   f"characters), e.g. {example!r}", 253)


def slurm_name(field: str, value, what: str, allow_list: bool = False) -> str:
    items = value.split(",") if allow_list and isinstance(value, str) else [value]
    rule = (f"a Slurm {what} name of letters, digits, '_', '.' and '-', starting with a letter "
            "or digit (no spaces, quotes or shell characters: it goes on an #SBATCH line)")
    if allow_list:
        rule += "; several as a comma-separated list"
    text(field, value)
    for item in items:
        if not item or SLURM_NAME.fullmatch(item) is None:
            raise ValueError(f"{field}: got {value!r}; accepted: {rule}")
    return value


def word(field: str, value, what: str) -> str:
    """Printable text that does not start with '-', which the command before it would read as
    one of its own options (srun for the python program, gpu_lab.rank.headless for the config path)."""
    text(field, value)
    if value.startswith("-"):
        raise ValueError(f"{field}: got {value!r}; accepted: {what} not starting with '-' (it "
                         "would be read as an option)")
    return value


def master_addr(field: str, value) -> str:
    text(field, value)
    if is_var_ref(value) or (len(value) <= 253 and HOST.fullmatch(value)):
        return value
    raise ValueError(f"{field}: got {value!r}; accepted: a host name or IPv4 address (letters, "
                     "digits, '-' and '.'), or exactly one shell variable reference such as "
                     "'$MASTER_ADDR' or '${MASTER_ADDR}', expanded on each node")


def env(field: str, env) -> dict[str, str]:
    """Environment variables: C-identifier names, values of printable text."""
    if not isinstance(env, dict):
        raise TypeError(f"{field}: got {env!r} ({type(env).__name__}); expected a dict of "
                        "name -> value")
    out = {}
    for k, v in env.items():
        pattern(f"{field} name", k, C_IDENTIFIER,
                "an environment variable name of letters, digits and '_', not starting with a "
                "digit (a C identifier, as the shell and Kubernetes require)")
        if not isinstance(v, (str, int, float)) or isinstance(v, bool):
            raise TypeError(f"{field}[{k!r}]: got {v!r} ({type(v).__name__}); expected a string")
        out[k] = text(f"{field}[{k!r}]", str(v), allow_empty=True)
    return out


__all__ = ["is_var_ref", "text", "word", "pattern", "dns_label", "dns_subdomain", "slurm_name",
           "master_addr", "env", "VAR_REF", "C_IDENTIFIER", "DNS_LABEL", "DNS_SUBDOMAIN", "IMAGE",
           "SLURM_TIME", "QUANTITY", "MAX_NAME"]
