"""Counts of one wheel-matrix leg's pytest run, read from its JUnit XML (.ci/wheels).

``python .ci/wheel_results.py LEG.xml`` prints ``passed/failed/errors/skipped`` and the test time, one line,
and lists every skip with its reason. A skip is a failure of the leg: each selected test exercises the wheel
(the native client included), so a skip means something the matrix claims was not run. Exit status 1 then,
or when anything failed or errored, or when nothing ran.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def main() -> int:
    root = ET.parse(sys.argv[1]).getroot()
    cases = list(root.iter("testcase"))
    failed = errors = skipped = 0
    skips = []
    for case in cases:
        if case.find("failure") is not None:
            failed += 1
        elif case.find("error") is not None:
            errors += 1
        elif (skip := case.find("skipped")) is not None:
            skipped += 1
            skips.append(f"  skipped {case.get('classname')}::{case.get('name')}: {skip.get('message')}")
    # Errors in set-up/tear-down of a test that also passed are reported as extra <error> testcases by pytest.
    passed = len(cases) - failed - errors - skipped
    seconds = sum(float(suite.get("time", 0)) for suite in root.iter("testsuite"))
    print(f"{passed} passed, {failed} failed, {errors} errors, {skipped} skipped in {seconds:.1f} s")
    for line in skips:
        print(line)
    return 1 if failed or errors or skipped or passed == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
