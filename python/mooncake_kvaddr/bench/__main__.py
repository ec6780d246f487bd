"""``python -m mooncake_kvaddr.bench``; Ctrl-C ends it with one line and exit status 130 (``_cli``)."""

from mooncake_kvaddr._cli import exit_on_interrupt
from mooncake_kvaddr.bench.cli import main

with exit_on_interrupt():
    status = main()
raise SystemExit(status)
