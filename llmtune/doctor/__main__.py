import os
import sys

from llmtune.doctor.rank import main

_code = 1
try:
    _code = main(sys.argv[1:])
finally:
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(_code)  # gloo's threads and interpreter finalization don't mix (see llmtune/train/__main__.py)
