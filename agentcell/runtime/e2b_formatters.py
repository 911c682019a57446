"""The extra result formats of E2B's code interpreter, as its template installs them in IPython.

E2B's kernels run startup scripts (template/startup_scripts in e2b-dev/code-interpreter) that add
three formatters and patch Pillow; this module does the same to agentcell's shell, so a result has
the same fields with the same contents:

* ``e2b/data``: a pandas DataFrame as ``df.to_dict(orient="list")``, Timestamps as ISO strings.
* ``e2b/chart``: a Matplotlib figure as E2B's chart dict (line, scatter, bar, pie, box-and-whisker,
  superchart), made by E2B's own ``e2b_charts`` package (MIT).
* ``application/json``: a list or dict last expression as JSON (NumPy values and non-string keys
  too, through orjson), as well as objects with ``_repr_json_``.
* Pillow: ``Image.show()`` and ``Image.save("path")`` display the image (a PNG result).
"""

from __future__ import annotations

import sys
from typing import Any

from IPython.core.formatters import BaseFormatter, JSONFormatter
from IPython.core.interactiveshell import InteractiveShell
from traitlets import ObjectName, Unicode


class DataFormatter(BaseFormatter):
    """A DataFrame -> its columns as lists (E2B's ``result.data``)."""

    format_type = Unicode("e2b/data")
    print_method = ObjectName("_repr_e2b_data_")
    _return_type = (dict, str)

    def __call__(self, obj: Any) -> Any:
        pandas = sys.modules.get("pandas")  # a DataFrame exists only if pandas is imported
        if pandas is None or not isinstance(obj, pandas.DataFrame):
            return super().__call__(obj)
        result = obj.to_dict(orient="list")
        for key, values in result.items():
            result[key] = [v.isoformat() if isinstance(v, pandas.Timestamp) else v for v in values]
        return result


class ChartFormatter(BaseFormatter):
    """A Matplotlib figure -> E2B's chart dict ({} when the figure holds nothing it understands)."""

    format_type = Unicode("e2b/chart")
    print_method = ObjectName("_repr_e2b_chart_")
    _return_type = (dict, str)

    def __call__(self, obj: Any) -> Any:
        figure_module = sys.modules.get("matplotlib.figure")
        if figure_module is None or not isinstance(obj, figure_module.Figure):
            return super().__call__(obj)
        from e2b_charts import chart_figure_to_dict  # imported in the zygote by its warm-up

        try:
            return chart_figure_to_dict(obj)
        except Exception:  # as E2B: a figure the extractor cannot read still has its PNG
            return {}


class E2BJSONFormatter(JSONFormatter):
    """Lists and dicts as ``application/json`` too, NumPy values included (E2B uses orjson)."""

    def __call__(self, obj: Any) -> Any:
        if isinstance(obj, list | dict):
            import orjson

            try:
                return orjson.loads(orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS)), {
                    "expanded": True
                }
            except TypeError:  # something orjson cannot encode: only what _repr_json_ gives
                pass
        return super().__call__(obj)


def install(shell: InteractiveShell) -> None:
    """Add E2B's formatters to `shell` and make Pillow display images (call once, in the zygote)."""
    formatter = shell.display_formatter
    formatter.formatters["e2b/data"] = DataFormatter(parent=formatter)
    formatter.formatters["e2b/chart"] = ChartFormatter(parent=formatter)
    formatter.formatters["application/json"] = E2BJSONFormatter(parent=formatter)
    _patch_pillow()


def _patch_pillow() -> None:
    """As E2B's 0003_images.py: no external viewer (show() falls through to IPython's display), and
    saving to a path displays the image too."""
    from IPython.display import display
    from PIL import Image, ImageShow

    if getattr(Image.Image.save, "_agentcell", False):
        return

    def show_file(self: Any, path: str, **options: Any) -> int:
        return 0  # no display server in a sandbox: the next viewer (IPython's) shows it

    ImageShow.UnixViewer.show_file = show_file  # type: ignore[method-assign]
    original_save = Image.Image.save

    def save(image: Image.Image, fp: Any, format: str | None = None, **options: Any) -> None:
        if isinstance(fp, str):
            display(image)
        original_save(image, fp, format, **options)

    save._agentcell = True  # type: ignore[attr-defined]
    Image.Image.save = save  # type: ignore[method-assign]
