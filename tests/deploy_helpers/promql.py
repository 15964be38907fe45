"""The series a PromQL expression reads, found by a small tokenizer (no PromQL parser in Python).

`selectors` returns each vector selector's metric name with the label names its matchers use.
What is not a metric name is dropped first: quoted strings, range and subquery brackets, the
label lists of ``by``/``without``/``on``/``ignoring``/``group_left``/``group_right``, Grafana
variables (``$__rate_interval``), numbers and durations; then an identifier followed by ``(`` is
a function or an aggregation, and the binary-operator keywords are not names. Recording rule
names (``level:metric:operations``) come back too: the caller tells them from exported series.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GRAFANA_VARIABLE = re.compile(r"\$\{\w+\}|\$\w+")
_RANGE = re.compile(r"\[[^\]]*\]")
_LABEL_LIST = re.compile(
    r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", re.IGNORECASE
)
# An identifier not glued to a digit or a dot (so not the "m" of 5m nor the "e" of 1e3),
# optionally followed by its label matchers, then whatever comes next.
_TOKEN = re.compile(r"(?<![\w.:])([A-Za-z_:][\w:]*)\s*(\{[^}]*\})?\s*(\()?")
_MATCHER_LABEL = re.compile(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)")
_KEYWORDS = {
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "atan2",
    "inf",
    "nan",
}


@dataclass(frozen=True)
class Selector:
    name: str
    labels: frozenset[str]


def selectors(expr: str) -> set[Selector]:
    """The vector selectors of ``expr``: metric (or recording rule) names and matcher labels."""
    # Matcher values go with the strings; a blank keeps `name{label=""}` a selector.
    text = _STRING.sub('""', expr)
    text = _GRAFANA_VARIABLE.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _LABEL_LIST.sub(" ", text)
    found: set[Selector] = set()
    for match in _TOKEN.finditer(text):
        name, matchers, call = match.groups()
        if call is not None or name.lower() in _KEYWORDS:
            continue
        labels = frozenset(_MATCHER_LABEL.findall(matchers or ""))
        found.add(Selector(name, labels))
    return found


def names(expr: str) -> set[str]:
    """The metric and recording-rule names ``expr`` reads."""
    return {selector.name for selector in selectors(expr)}
