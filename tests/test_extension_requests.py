"""Requests of the lab extension that survive a failed fetch (issue 60, item 2).

Fast: each request path that froze a view is checked in extension/src, as text, for what its fix
is made of (these fail on the sources before the fix, one per path):
  - runmodel.ts read a failed run's triage with getRun(...).then(...) and no rejection handler;
  - index.ts awaited model.info() outside any try;
  - compare.ts (and model.ts, runmodel.ts) polled with hand-rolled timers, and the comparison's
    stopped for good at its first error;
  - model.ts read response.text() outside its try.
Slow (they start Node): the model, run-view model and comparison model themselves, with fetch
and the websocket failing the way a server that goes away fails them (tests/extension_node.js)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import ext_node

SRC = ext_node.SRC

# --- the sources, as code: comments and strings blanked ------------------------------------------


def _code(text: str) -> str:
    """`text` with comments and the inside of strings replaced by spaces (same length and lines),
    so that braces, parentheses and names are the code's own. A template literal's ${...} stays
    code."""
    out = list(text)
    i, n = 0, len(text)
    stack: list[str] = []  # open template literals (`) and the ${ braces inside them ({)

    def blank(a: int, b: int) -> None:
        for k in range(a, b):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = text[i]
        in_template = bool(stack) and stack[-1] == "`"
        if in_template:
            if c == "\\":
                blank(i, i + 2)
                i += 2
            elif c == "`":
                stack.pop()
                i += 1
            elif text.startswith("${", i):
                stack.append("{")
                i += 2
            else:
                blank(i, i + 1)
                i += 1
            continue
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            blank(i, j)
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2) + 2
            blank(i, j)
            i = j
        elif c in "'\"":
            j = i + 1
            while text[j] != c:
                j += 2 if text[j] == "\\" else 1
            blank(i + 1, j)
            i = j + 1
        elif c == "`":
            stack.append("`")
            i += 1
        elif c == "{" and stack:
            stack.append("{")
            i += 1
        elif c == "}" and stack and stack[-1] == "{":
            stack.pop()
            i += 1
        else:
            i += 1
    return "".join(out)


def _close(code: str, at: int) -> int:
    """The index of the bracket that closes the one at `at`."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    want = [pairs[code[at]]]
    for i in range(at + 1, len(code)):
        c = code[i]
        if c in pairs:
            want.append(pairs[c])
        elif c in ")}]":
            assert c == want.pop(), (c, code[at:i + 1][-200:])
            if not want:
                return i
    raise AssertionError("unclosed bracket")


def _try_blocks(code: str) -> list[tuple[int, int]]:
    """The [start, end) spans of every `try { ... }` body."""
    spans = []
    for m in re.finditer(r"\btry\s*\{", code):
        start = m.end() - 1
        spans.append((start, _close(code, start)))
    return spans


def _in_try(code: str, at: int) -> bool:
    return any(a < at < b for a, b in _try_blocks(code))


def _line(code: str, at: int) -> int:
    return code.count("\n", 0, at) + 1


def _sources() -> dict[str, str]:
    return {p.name: _code(p.read_text()) for p in sorted(SRC.glob("*.ts"))}


def test_the_code_reader_blanks_comments_and_strings():
    code = _code("a('x{', `t ${b({})} }`) // c {\n/* { */ d")
    assert code.count("{") == code.count("}") == 2 and "c" not in code and "d" in code


# --- one check per path that froze a view ----------------------------------------------------------

def test_every_then_handles_a_rejection():
    """runmodel.ts: the triage read when a run ends failed was getRun(...).then(...) with no
    catch: a failed fetch was an uncaught rejection, and the triage was never read again."""
    bad = []
    for name, code in _sources().items():
        for m in re.finditer(r"\.then\(", code):
            end = _close(code, m.end() - 1)
            args, depth, commas = code[m.end():end], 0, 0
            for c in args:
                depth += c in "([{"
                depth -= c in ")]}"
                commas += c == "," and depth == 0
            if commas < 1 and not re.match(r"\s*\.catch\(", code[end + 1:]):
                bad.append(f"{name}:{_line(code, m.start())}")
    assert not bad, f".then(...) without a rejection handler at {bad}"


REQUESTS = r"\b(info|getRun|compare|runEvents|readLog|telemetryHistory|stopRun|resumeRun|" \
           r"requestCheckpoint)\("


def test_the_plugins_requests_are_caught():
    """index.ts: the tutorials command awaited model.info() with no catch (an uncaught error for
    a click while the server is away). Every request the plugin awaits sits in a try."""
    code = _sources()["index.ts"]
    awaited = [m for m in re.finditer(r"await\s+model\.(\w+)\(", code)
               if re.match(REQUESTS, m.group(1) + "(")]
    assert awaited, "index.ts awaits no request: the check reads the wrong thing"
    bad = [f"index.ts:{_line(code, m.start())}: model.{m.group(1)}()" for m in awaited
           if not _in_try(code, m.start())]
    assert not bad, f"awaited outside a try: {bad}"


def test_polls_and_reconnects_are_lumino_polls():
    """compare.ts rescheduled its refresh only after a success, so one failed fetch stopped a
    live comparison for good; model.ts and runmodel.ts polled and reconnected with hand-rolled
    timers. No timer of the extension's makes a request now: the modules that request again and
    again (the runs list, the socket, a run view without its socket, a comparison) do it on a
    @lumino/polling Poll, which backs off after a failure and goes on."""
    sources = _sources()
    timers = [f"{name}:{_line(code, m.start())}" for name, code in sources.items()
              for m in re.finditer(r"\b(setInterval|setTimeout)\(", code)
              if name != "runview.ts"]  # its redraw throttle, which requests nothing
    assert not timers, f"hand-rolled timers: {timers}"
    for name in ("model.ts", "runmodel.ts", "comparemodel.ts"):
        assert name in sources, f"{name} is missing"
        assert "new Poll(" in sources[name], f"{name} makes no Poll"
    view = sources["compare.ts"]
    assert not re.search(r"\.compare\(", view), "compare.ts fetches by itself again"


def test_a_body_is_read_inside_the_try():
    """model.ts: requestAPI read response.text() outside its try, so a reply cut after its
    headers was not a NetworkError (the retry paths tell a lost connection by it)."""
    code = _sources()["model.ts"]
    reads = [m.start() for m in re.finditer(r"\bresponse\.text\(\)", code)]
    assert reads, "model.ts reads no response body: the check reads the wrong thing"
    assert all(_in_try(code, at) for at in reads), [_line(code, at) for at in reads]


# --- in Node: the models under a server that goes away -----------------------------------------------

@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return ext_node.build(tmp_path_factory.mktemp("ext"))


@pytest.mark.slow
def test_requests_fail_as_network_errors_or_refusals(built):
    seen = ext_node.run(built, "requests")["seen"]
    # a body cut mid-reply is a lost connection, like a refused one; a 404 is the server's answer
    assert seen["cut"]["network"] and seen["refused"]["network"], seen
    assert seen["refusal"] == {"network": False, "response": True,
                               "message": "no run with id x"}, seen


@pytest.mark.slow
def test_a_failed_runs_triage_is_read_once_the_server_answers(built):
    facts = ext_node.run(built, "triage")
    assert facts["unhandled"] == [], facts
    # two refused tries, then the triage, within the backoff's first seconds
    assert facts["triageTries"] == 3, facts
    assert facts["after"]["30"] == "rank 0: ValueError: boom", facts


@pytest.mark.slow
def test_a_run_view_opens_once_the_server_answers(built):
    facts = ext_node.run(built, "open")
    down = facts["whileDown"]
    assert down["opened"] is None and down["feed"] == "reconnecting" and down["tries"] >= 3, facts
    assert facts["opened"] == "opened" and facts["steps"] == [0, 1, 2], facts
    # a run the server does not know: refused at once, not retried
    assert facts["refusal"] == "no run with id nope" and facts["nopeTries"] == 1, facts
    assert facts["unhandled"] == [], facts


@pytest.mark.slow
def test_the_socket_reopens_and_follows_from_where_the_view_stands(built):
    facts = ext_node.run(built, "socket")
    assert facts["firstFollow"] == [{"follow": "r1", "after": 3, "logs": {}}], facts
    # away: both the socket and the view's polls say so, and keep trying
    assert facts["down"]["feed"] == facts["down"]["state"] == "reconnecting", facts
    assert facts["down"]["sockets"] >= 3, facts
    # the REST endpoints back first: the view polls from where it stood, every step once
    assert facts["polled"] == {"feed": "polling", "steps": list(range(12))}, facts
    # then the socket: it follows the run from the view's newest event, and the view is live
    assert facts["refollow"] == [{"follow": "r1", "after": 12, "logs": {}}], facts
    assert facts["live"] == {"feed": "live", "state": "live", "steps": list(range(14))}, facts
    assert facts["pollsLive"] == 0, facts  # live: no polling
    assert facts["states"] == ["live", "reconnecting", "live"], facts
    assert facts["unhandled"] == [], facts


@pytest.mark.slow
def test_the_runs_list_says_it_reconnects_and_comes_back_at_once(built):
    facts = ext_node.run(built, "runs")
    assert facts["live"] == {"state": "live", "runs": 1}, facts
    assert facts["down"] == {"state": "reconnecting", "reason": "Failed to fetch"}, facts
    # after a minute away the poll waits up to 30 s between tries; the socket's return asks now
    assert facts["back"] == {"state": "live", "runsAfterOpen": 0}, facts
    assert facts["unhandled"] == [], facts


@pytest.mark.slow
def test_a_live_comparison_survives_failed_fetches(built):
    facts = ext_node.run(built, "compare")
    assert facts["live"] >= 3, facts  # every 5 s while a run is active
    assert facts["down"]["state"] == "reconnecting" and facts["down"]["fetches"] >= 2, facts
    assert facts["back"]["state"] == "live", facts
    assert facts["atOnce"] == 0, facts  # the lab's socket back: fetched at once
    assert facts["ended"]["state"] == "ended" and facts["endedFetches"] == 0, facts
    assert facts["states"] == ["live", "reconnecting", "live", "ended"], facts
    assert facts["unhandled"] == [], facts
