"""Checks on an HTML page meant to be self-contained (the HTML behaviour report): parsed, not grepped,
so that a record value that reads `src=` or `https://` in the page's text is not taken for markup."""

from __future__ import annotations

from html.parser import HTMLParser

# elements that load or run something, or send the reader elsewhere
LOADING_TAGS = frozenset({"script", "link", "img", "iframe", "frame", "object", "embed", "video", "audio",
                          "source", "track", "base", "form", "input", "svg", "image", "meta"})
URL_ATTRIBUTES = frozenset({"src", "href", "action", "formaction", "srcset", "poster", "data", "background",
                            "xlink:href", "ping", "manifest", "http-equiv"})


class _Collect(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, list[tuple[str, str | None]]]] = []
        self.styles: list[str] = []
        self._in_style = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, attrs))
        self._in_style = tag == "style"

    def handle_endtag(self, tag: str) -> None:
        self._in_style = False

    def handle_data(self, data: str) -> None:
        if self._in_style:
            self.styles.append(data)


def page_tags(page: str) -> list[tuple[str, list[tuple[str, str | None]]]]:
    parser = _Collect()
    parser.feed(page)
    parser.close()
    return parser.tags


def assert_self_contained(page: str) -> None:
    """No element that loads anything, no link but to an anchor in the page, no event handler, no style
    that fetches (url(), @import): the page renders offline under `default-src 'none'`."""
    parser = _Collect()
    parser.feed(page)
    parser.close()
    for tag, attrs in parser.tags:
        metas = {"charset", "name", "content"}
        if tag == "meta":
            assert {k for k, _ in attrs} <= metas, attrs
            continue
        assert tag not in LOADING_TAGS, (tag, attrs)
        for name, value in attrs:
            assert not name.startswith("on"), (tag, name)  # no event handler
            if name in URL_ATTRIBUTES:
                assert name == "href" and (value or "").startswith("#"), (tag, name, value)
            assert name != "style" or "url(" not in (value or ""), (tag, value)
    css = "".join(parser.styles)
    assert "url(" not in css and "@import" not in css
