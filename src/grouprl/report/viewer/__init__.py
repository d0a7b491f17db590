"""The run viewer (`grouprl view`): a run's curves, a logged step's whole groups with their
rewards and advantages, and each completion token by token, coloured by the ratio the loss used
(in units of the clip range), the change after the step, the advantage or the entropy, with the
tokens the clip acted on outlined. Served from the stdlib on 127.0.0.1, or exported as one HTML
file; the page's JS and CSS are package data (no CDN, no build). The records are written by
`grouprl train` (`grouprl.train.groups`)."""

from grouprl.report.viewer.data import run_dirs, summary
from grouprl.report.viewer.server import ViewerServer, export_html, page

__all__ = ["ViewerServer", "export_html", "page", "run_dirs", "summary"]
