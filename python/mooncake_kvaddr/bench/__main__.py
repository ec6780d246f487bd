"""``python -m mooncake_kvaddr.bench``."""

from mooncake_kvaddr.bench.cli import main

raise SystemExit(main())
