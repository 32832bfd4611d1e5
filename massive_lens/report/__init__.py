"""The HTML and Markdown report: every analysis on one model, one page (:func:`write_report`),
or several models side by side (:func:`compare_models`)."""

from massive_lens.report.compare import compare_models
from massive_lens.report.inputs import DEFAULT, FULL, QUICK, ReportOptions
from massive_lens.report.write import write_report

__all__ = ["DEFAULT", "FULL", "QUICK", "ReportOptions", "compare_models", "write_report"]
