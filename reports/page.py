"""The shell every HTML page of a report shares: styles, the partial-run banner, escaping helpers.

Pages are self-contained (inline CSS and scripts, images next to them), so a report directory can be
opened from disk, uploaded as a CI artifact or served as is.
"""

from __future__ import annotations

import html

CSS = """
body { font-family: system-ui, sans-serif; margin: 1.2em 1.5em; color: #222; max-width: 1600px; }
h1 { font-size: 1.5em; margin: 0.2em 0 0.4em; } h2 { font-size: 1.2em; margin-top: 1.4em; }
table { border-collapse: collapse; margin: 0.5em 0 1.2em; font-size: 13px; }
th, td { border: 1px solid #999; padding: 3px 6px; text-align: center; vertical-align: top; }
th { background: #f0f0f0; }
td.row { text-align: left; font-weight: bold; background: #f7f7f7; }
td.left, th.left { text-align: left; }
details summary { cursor: pointer; }
details ul { text-align: left; margin: 4px 0; padding-left: 1.2em; font-size: 11px; max-width: 40em; }
.warn { background: #fff3cd; border: 1px solid #e0b000; padding: 0.5em 1em; margin: 0.5em 0; }
.banner { background: #ffe5b4; border: 2px solid #d98000; padding: 0.6em 1em; margin: 0 0 0.8em; font-weight: bold; }
.legend span { display: inline-block; padding: 2px 8px; margin: 2px 6px 2px 0; border: 1px solid #999; font-size: 12px; }
code, pre { font-size: 12px; }
pre { background: #f6f6f6; border: 1px solid #ddd; padding: 0.5em; overflow: auto; max-height: 30em; white-space: pre-wrap; word-break: break-all; }
nav.toc { background: #f7f7f7; border: 1px solid #ddd; padding: 0.3em 0.8em; font-size: 13px; }
nav.toc ul { display: inline; margin: 0 0 0 0.8em; padding: 0; } nav.toc li { display: inline; margin-right: 0.9em; }
a { color: #0645ad; }
"""


def esc(value: object) -> str:
    return html.escape(str(value))


def banner_html(text: str) -> str:
    """The partial-run banner; empty when there is nothing to say."""
    return f'<div class="banner" id="partial-run">⚠️ {esc(text)}</div>' if text else ""


def page(title: str, body: str, *, script: str = "", css: str = "") -> str:
    """A whole HTML document around ``body``; ``css`` and ``script`` add to the shared style and script."""
    js = f"<script>{script}</script>" if script else ""
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<meta name='viewport' content='width=device-width'><title>{esc(title)}</title>"
        f"<style>{CSS}{css}</style></head><body>\n{body}\n{js}</body></html>\n"
    )
