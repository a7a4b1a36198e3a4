"""The text a reader sees on an HTML page (a report, or the browser's DOM of it)."""

from __future__ import annotations

import html.parser


class _Text(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.words: list[str] = []
        self.hidden = 0

    def handle_starttag(self, tag, attrs):
        self.hidden += tag in ("script", "style", "title")

    def handle_endtag(self, tag):
        self.hidden -= tag in ("script", "style", "title")

    def handle_data(self, data):
        if not self.hidden:
            self.words += data.split()


def visible_text(page: str) -> str:
    """The words of ``page`` outside scripts, styles and its title, joined by one space."""
    parser = _Text()
    parser.feed(page)
    return " ".join(parser.words)
