"""Print the slowest tests of a CI run and the totals, from the JUnit XML files pytest wrote.

    python .ci/slowest.py REPORT_DIR [N]
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def main(report_dir: str, n: int = 25) -> None:
    cases, suites = [], []
    for path in sorted(Path(report_dir).glob("*.xml")):
        root = ET.parse(path).getroot()
        for suite in root.iter("testsuite"):
            suites.append((path.stem, int(suite.get("tests", 0)), int(suite.get("failures", 0))
                           + int(suite.get("errors", 0)), int(suite.get("skipped", 0)), float(suite.get("time", 0))))
        for case in root.iter("testcase"):
            cases.append((float(case.get("time", 0)), f"{path.stem}: {case.get('classname')}::{case.get('name')}"))
    if not suites:
        print(f"no test reports in {report_dir}")
        return
    print(f"\n{n} slowest tests:")
    for seconds, name in sorted(cases, reverse=True)[:n]:
        print(f"  {seconds:8.1f} s  {name}")
    print("\nsuite            tests  failed  skipped    time")
    for name, tests, failed, skipped, seconds in suites:
        print(f"  {name:<14} {tests:5d}  {failed:6d}  {skipped:7d}  {seconds:6.0f} s")
    total = sum(s[1] for s in suites)
    print(f"  {'total':<14} {total:5d}  {sum(s[2] for s in suites):6d}  {sum(s[3] for s in suites):7d}  "
          f"{sum(s[4] for s in suites):6.0f} s")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 25)
