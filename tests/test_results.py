"""Code-interpreter results as E2B's: result.data, result.chart, images, mime types, streaming.

Everything goes through the unchanged e2b_code_interpreter SDK (Execution/Result objects), which is
how E2B's users read these fields.
"""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from collections.abc import Iterator

import pytest
from e2b_code_interpreter import Sandbox
from e2b_code_interpreter.charts import (
    BarChart,
    BoxAndWhiskerChart,
    ChartType,
    LineChart,
    PieChart,
    ScatterChart,
    SuperChart,
)


@pytest.fixture(scope="module")
def code(e2b_env: str) -> Iterator[Sandbox]:
    s = Sandbox.create()
    yield s
    s.kill()


def _ok(code: Sandbox, source: str):
    ex = code.run_code(source)
    assert ex.error is None, ex.error
    return ex


def _png(b64: str | None) -> bytes:
    assert b64, "no png"
    data = base64.b64decode(b64)
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    return data


# -- pandas -----------------------------------------------------------------------------------------


def test_dataframe_data_is_its_columns_as_lists(code: Sandbox) -> None:
    ex = _ok(code, "import pandas as pd\n"
                   "pd.DataFrame({'a': [1, 2, 3], 'b': ['x', 'y', None],\n"
                   "              'f': [0.5, float('nan'), 2.0],\n"
                   "              't': pd.to_datetime(['2024-01-02', '2024-03-04', '2024-05-06'])})")  # fmt: skip
    result = ex.results[0]
    assert result.is_main_result
    assert result.data == {
        "a": [1, 2, 3],
        "b": ["x", "y", None],
        "f": [0.5, None, 2.0],  # NaN: JSON has none, null instead
        "t": ["2024-01-02T00:00:00", "2024-03-04T00:00:00", "2024-05-06T00:00:00"],  # as E2B: ISO strings
    }
    assert "<table" in (result.html or "") and "a" in (result.text or "")
    assert result.formats() == ["text", "html", "data"]


def test_non_dataframes_have_no_data(code: Sandbox) -> None:
    ex = _ok(code, "import pandas as pd\npd.Series([1, 2])")
    assert ex.results[0].data is None
    assert _ok(code, "1 + 1").results[0].formats() == ["text"]


# -- charts (e2b_charts, through the SDK's chart classes) ------------------------------------------


def test_line_chart(code: Sandbox) -> None:
    ex = _ok(code, "import matplotlib.pyplot as plt\nimport numpy as np\n"
                   "x = np.linspace(0, 2, 50)\n"
                   "plt.plot(x, x ** 2, label='square')\nplt.plot(x, x, label='id')\n"
                   "plt.title('Lines'); plt.xlabel('X'); plt.ylabel('Y')\nplt.show()")  # fmt: skip
    [result] = ex.results
    _png(result.png)
    chart = result.chart
    assert isinstance(chart, LineChart) and chart.type == ChartType.LINE
    assert (chart.title, chart.x_label, chart.y_label) == ("Lines", "X", "Y")
    assert [e.label for e in chart.elements] == ["square", "id"]
    assert len(chart.elements[0].points) == 50
    assert chart.elements[0].points[-1] == pytest.approx((2.0, 4.0))


def test_scatter_chart(code: Sandbox) -> None:
    ex = _ok(code, "import matplotlib.pyplot as plt\n"
                   "plt.scatter([1, 2, 3], [4, 5, 6], label='pts')\nplt.show()")  # fmt: skip
    chart = ex.results[0].chart
    assert isinstance(chart, ScatterChart) and chart.type == ChartType.SCATTER
    assert [tuple(p) for p in chart.elements[0].points] == [(1, 4), (2, 5), (3, 6)]
    assert json.loads(ex.to_json())["results"][0]["chart"]["type"] == "scatter"


def test_bar_chart(code: Sandbox) -> None:
    ex = _ok(code, "import matplotlib.pyplot as plt\n"
                   "plt.bar(['apples', 'pears'], [3, 7], label='fruit')\nplt.title('Bars')\nplt.show()")  # fmt: skip
    chart = ex.results[0].chart
    assert isinstance(chart, BarChart) and chart.type == ChartType.BAR and chart.title == "Bars"
    assert [(e.label, e.value) for e in chart.elements] == [("apples", 3), ("pears", 7)]


def test_pie_chart(code: Sandbox) -> None:
    ex = _ok(code, "import matplotlib.pyplot as plt\n"
                   "plt.pie([1, 3], labels=['one', 'three'])\nplt.show()")  # fmt: skip
    chart = ex.results[0].chart
    assert isinstance(chart, PieChart) and chart.type == ChartType.PIE
    assert [e.label for e in chart.elements] == ["one", "three"]
    assert chart.elements[1].angle == pytest.approx(270)


def test_box_and_whisker_chart(code: Sandbox) -> None:
    ex = _ok(code, "import matplotlib.pyplot as plt\n"
                   "fig, ax = plt.subplots()\n"
                   "ax.boxplot([[1, 2, 3, 4, 5], [2, 4, 6, 8, 10]], labels=['A', 'B'], patch_artist=True)\nplt.show()")  # fmt: skip
    chart = ex.results[0].chart
    assert isinstance(chart, BoxAndWhiskerChart) and chart.type == ChartType.BOX_AND_WHISKER
    assert [e.label for e in chart.elements] == ["A", "B"]
    assert (chart.elements[0].min, chart.elements[0].median, chart.elements[0].max) == (1, 3, 5)


def test_superchart_of_subplots(code: Sandbox) -> None:
    ex = _ok(code, "import matplotlib.pyplot as plt\n"
                   "fig, axs = plt.subplots(1, 2)\nfig.suptitle('Both')\n"
                   "axs[0].plot([1, 2], [3, 4])\naxs[1].scatter([1], [2])\nplt.show()")  # fmt: skip
    chart = ex.results[0].chart
    assert isinstance(chart, SuperChart) and chart.type == ChartType.SUPERCHART and chart.title == "Both"
    assert [type(c) for c in chart.elements] == [LineChart, ScatterChart]


def test_figure_as_last_expression_and_blank_figure(code: Sandbox) -> None:
    ex = _ok(code, "import matplotlib.pyplot as plt\nfig, ax = plt.subplots()\nax.plot([1, 2])\nplt.close(fig)\nfig")
    [result] = ex.results
    assert result.is_main_result and isinstance(result.chart, LineChart)
    _png(result.png)
    ex = _ok(code, "import matplotlib.pyplot as plt\nplt.figure()\nplt.show()")
    assert all(r.chart is None for r in ex.results)  # nothing drawn: no chart (E2B's {})


def test_several_figures_give_several_results(code: Sandbox) -> None:
    ex = _ok(code, "import matplotlib.pyplot as plt\n"
                   "for i in range(3):\n"
                   "    plt.figure()\n"
                   "    plt.plot([0, i + 1])\n"
                   "plt.show()\n"
                   "plt.figure(); plt.bar(['a'], [1]); plt.show()")  # fmt: skip
    assert [type(r.chart) for r in ex.results] == [LineChart, LineChart, LineChart, BarChart]
    assert all(not r.is_main_result for r in ex.results)
    assert len({r.png for r in ex.results}) == 4


def test_seaborn_plot_is_a_chart(code: Sandbox) -> None:
    ex = _ok(code, "import seaborn as sns\nimport matplotlib.pyplot as plt\n"
                   "sns.barplot(x=['a', 'b', 'c'], y=[1, 2, 3])\nplt.show()")  # fmt: skip
    [result] = ex.results
    _png(result.png)
    assert isinstance(result.chart, BarChart) and len(result.chart.elements) == 3


# -- images ---------------------------------------------------------------------------------------


PIL_IMAGE = "from PIL import Image\nimg = Image.new('RGB', (6, 4), (255, 0, 0))\n"


def _decode_image(b64: str | None) -> tuple[tuple[int, int], tuple[int, ...]]:
    from PIL import Image

    with Image.open(io.BytesIO(_png(b64))) as im:
        return im.size, im.convert("RGB").getpixel((0, 0))


def test_pil_image_last_expression_is_png(code: Sandbox) -> None:
    [result] = _ok(code, PIL_IMAGE + "img").results
    assert result.is_main_result
    assert _decode_image(result.png) == ((6, 4), (255, 0, 0))


def test_pil_image_display_show_and_save(code: Sandbox) -> None:
    ex = _ok(code, PIL_IMAGE + "from IPython.display import display\n"
                   "display(img)\nimg.show()\nimg.save('/tmp/red.png')\nprint('saved')")  # fmt: skip
    assert len(ex.results) == 3  # display, show (E2B: no viewer but IPython's), save to a path (E2B's hook)
    for result in ex.results:
        assert not result.is_main_result and _decode_image(result.png) == ((6, 4), (255, 0, 0))
    assert ex.logs.stdout == ["saved\n"]
    assert code.files.read("/tmp/red.png", format="bytes").startswith(b"\x89PNG")


# -- mime types -----------------------------------------------------------------------------------


def test_each_mime_type_has_its_field(code: Sandbox) -> None:
    ex = _ok(code, "from IPython.display import display, Markdown, Latex, JSON, Javascript, HTML, SVG\n"
                   "display(Markdown('# title'))\n"
                   "display(Latex(r'$x^2$'))\n"
                   "display(JSON({'k': [1, 2]}))\n"
                   "display(Javascript('console.log(1)'))\n"
                   "display(HTML('<b>bold</b>'))\n"
                   "display(SVG('<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"1\" height=\"1\"/>'))\n"
                   "display({'image/jpeg': b'\\xff\\xd8jpeg', 'text/plain': 'j'}, raw=True)\n")  # fmt: skip
    fields = [(r.formats(), r) for r in ex.results]
    assert [f for f, _ in fields] == [
        ["text", "markdown"], ["text", "latex"], ["text", "json"], ["text", "javascript"],
        ["text", "html"], ["text", "svg"], ["text", "jpeg"],
    ]  # fmt: skip
    r = [r for _, r in fields]
    assert r[0].markdown == "# title" and r[1].latex == "$x^2$" and r[2].json == {"k": [1, 2]}
    assert r[3].javascript == "console.log(1)" and r[4].html == "<b>bold</b>" and "<svg" in (r[5].svg or "")
    assert base64.b64decode(r[6].jpeg) == b"\xff\xd8jpeg"


def test_repr_methods_mimebundle_pdf_and_extra(code: Sandbox) -> None:
    ex = _ok(code, "class Bundle:\n"
                   "    def _repr_mimebundle_(self, include=None, exclude=None):\n"
                   "        return {'text/plain': 'B', 'application/pdf': b'%PDF-1.4 b', 'application/x-mine': 'z'}\n"
                   "class Reprs:\n"
                   "    def _repr_markdown_(self): return '*m*'\n"
                   "    def _repr_latex_(self): return r'$y$'\n"
                   "    def _repr_html_(self): return '<i>h</i>'\n"
                   "display(Bundle())\nReprs()")  # fmt: skip
    bundle, reprs = ex.results
    assert bundle.text == "B" and base64.b64decode(bundle.pdf) == b"%PDF-1.4 b"
    assert bundle.extra == {"application/x-mine": "z"}
    assert reprs.is_main_result and (reprs.markdown, reprs.latex, reprs.html) == ("*m*", "$y$", "<i>h</i>")


def test_raw_latex_only(code: Sandbox) -> None:  # E2B's test_custom_repr_object
    ex = _ok(code, "from IPython.display import display\n"
                   "display({'text/latex': r'\\text{CustomReprObject}'}, raw=True)")  # fmt: skip
    assert ex.results[0].formats() == ["latex"]


def test_list_and_dict_results_are_json(code: Sandbox) -> None:
    [result] = _ok(code, "import numpy as np\n{'a': [1, 2.5], 'n': np.int64(7), 'arr': np.arange(3)}").results
    assert result.json == {"a": [1, 2.5], "n": 7, "arr": [0, 1, 2]}
    assert _ok(code, "(1, 2)").results[0].json is None  # tuples: text only, as E2B
    long = _ok(code, "list(range(1500))").results[0]
    assert long.json == list(range(1500))
    assert "..." not in long.text and long.text.split()[-1] == "1499]"  # not cut at 1000 items, as E2B


# -- streaming ------------------------------------------------------------------------------------


def test_output_without_newline_streams_at_once(code: Sandbox) -> None:
    arrivals: list[tuple[float, str]] = []
    start = time.monotonic()
    lock = threading.Lock()

    def on_stdout(msg) -> None:
        with lock:
            arrivals.append((time.monotonic() - start, msg.line))

    ex = code.run_code('import time\nprint("a", end="")\ntime.sleep(3)\nprint("b")', on_stdout=on_stdout)
    assert ex.error is None
    assert "".join(line for _, line in arrivals) == "ab\n"
    first_time, first = arrivals[0]
    assert first == "a"
    assert first_time < 1.5, arrivals  # long before the 3 s sleep ends (usually ~10 ms)
    assert arrivals[-1][0] >= 3


def test_print_is_one_line_and_partial_writes_join(code: Sandbox) -> None:
    out: list[str] = []
    code.run_code("print(1)", on_stdout=lambda m: out.append(m.line))
    assert out == ["1\n"]  # E2B's test_streaming_output
    ex = _ok(code, "import sys\nfor i in range(3):\n    print(i, end=' ')\nprint()\n"
                   "sys.stderr.write('e'); sys.stderr.flush()")  # fmt: skip
    assert "".join(ex.logs.stdout) == "0 1 2 \n"
    assert ex.logs.stderr == ["e"]


def test_partial_output_in_a_forked_child_streams_too(code: Sandbox) -> None:
    ex = _ok(code, "import os, time\n"
                   "pid = os.fork()\n"
                   "if pid == 0:\n"
                   "    print('child', end='')\n"
                   "    time.sleep(0.5)\n"
                   "    os._exit(0)\n"
                   "os.waitpid(pid, 0)\n"
                   "print('|parent')")  # fmt: skip
    assert "".join(ex.logs.stdout) == "child|parent\n"
