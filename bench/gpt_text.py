"""examples/gpt.c's text for its Python twins (bench/torch_gpt.py, bench/tf_gpt.py):
the fortunes' files in name order, cut as mpt.h's text dataset cuts them."""
import os

FORTUNES = "/usr/share/games/fortunes"


def read_fortunes():
    """gpt.c's default text: every file of the fortunes but the .dat indexes
    and the .u8 links, in name (byte) order, one after another."""
    names = sorted(n for n in os.listdir(os.fsencode(FORTUNES))
                   if not n.startswith(b".") and not n.endswith(b".dat")
                   and not n.endswith(b".u8"))
    parts = []
    for n in names:
        with open(os.path.join(os.fsencode(FORTUNES), n), "rb") as f:
            parts.append(f.read())
    return b"".join(parts)


def read_text(path):
    """The text a run trains on: the file at path, or the fortunes (None)."""
    if path:
        with open(path, "rb") as f:
            return f.read()
    return read_fortunes()


def cut(text):
    """(train, validation) bytes: mpt.h's cut, int(size · (1 - 0.1))."""
    at = int(len(text) * (1.0 - 0.1))
    return text[:at], text[at:]
