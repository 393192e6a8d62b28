"""Is this Python one quantpipe supports? `make` runs it before it creates or installs anything,
with the Python it would use, so an unsupported one is one line, not a failed download.
Plain syntax on purpose: it must run, and say why, on any Python 3."""

import sys

SUPPORTED = ((3, 11), (3, 12), (3, 13))  # pyproject.toml's requires-python; CI tests each

version = tuple(sys.version_info[:2])
if version not in SUPPORTED:
    sys.exit("error: Python %d.%d (%s) is not supported: quantpipe needs %s; run "
             "`make PYTHON=python3.12 ...` (the virtualenv is made with it) or activate a "
             "virtualenv of one of them"
             % (version[0], version[1], sys.executable,
                ", ".join("%d.%d" % v for v in SUPPORTED)))
