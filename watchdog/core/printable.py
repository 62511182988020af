"""Text read from a file, made safe to print on a terminal. Pure.

A flight record, a trace's path, a log or a job file may hold anything, and a terminal obeys
escape sequences: ESC ]52 writes the clipboard on many terminals, ESC [2J clears the screen. Every
text from a file that a command prints for a person goes through `printable` (JSON output escapes
by itself): `hbm-watchdog`'s standard output is a `PrintableStream`, its one-line errors and the
console's log lines are made printable field by field: a character that is not printable (escape and control characters, line and paragraph
separators, the rest of Unicode's C and Z classes but the space) is shown as its Python escape,
`\\x1b`, so what the file held stays readable and nothing of it acts.
"""

from __future__ import annotations


def printable(text: object) -> str:
    """`text` as a string with every non-printable character written as its escape (`\\x1b`, `\\n`)."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else char.encode("unicode_escape").decode("ascii") for char in text)


def printable_lines(text: str) -> str:
    """`printable` for each line of `text`, the line breaks kept."""
    return "\n".join(printable(line) for line in text.split("\n"))


class PrintableStream:
    """A text stream whose writes reach the terminal made printable, line breaks and tabs kept: what
    a command prints of a file (a trace's phase label, a job record's action kind, a path) never
    acts on the terminal. Everything else (its `buffer` for a child's own bytes, `flush`,
    `isatty`) is the stream's."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write("\t".join(printable_lines(part) for part in text.split("\t")))
        return len(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)
