"""The HTML and Markdown report (:func:`write_report`): every analysis on one model, one page."""

from massive_lens.report.sections import FULL, QUICK, Settings
from massive_lens.report.write import write_report

__all__ = ["FULL", "QUICK", "Settings", "write_report"]
