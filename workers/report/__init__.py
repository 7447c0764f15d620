"""The run report: one offline HTML page built in one streaming pass over a run's files.

stats.py    streaming summaries: log histogram, doubling bins, reservoir, top-k, pass@k
digest.py   the pass: health reports first, then each source's results and failures
svg.py      the charts, as inline SVG
sections.py each section of the page, from the digest
page.py     the page: styles, the transcript viewer and sorting script, data inline
build.py    build and save it (`rollouts report`, the finish step's `report.html`)
"""

from workers.report.build import REPORT_NAME, build_report, save, write_report
from workers.report.digest import RunDigest, TaskTable, digest_run
from workers.report.page import render

__all__ = [
    "REPORT_NAME",
    "RunDigest",
    "TaskTable",
    "build_report",
    "digest_run",
    "render",
    "save",
    "write_report",
]
