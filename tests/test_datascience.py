"""The default template's data-science runtime (E2B's code-interpreter set, pyproject's `datascience`
extra): each package imports inside a sandbox and does one small real thing there.

Sandboxes have no network, so nothing here downloads data (NLTK corpora, spaCy models, plotly's
Chrome for static export): each package works on what it ships or what the cell makes.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator

import pytest
from e2b_code_interpreter import Sandbox
from e2b_code_interpreter.charts import BarChart, ScatterChart

CASES: dict[str, tuple[str, str]] = {
    # package: (cell, the text of its last expression)
    "scipy": ("from scipy import optimize\n"
              "r = optimize.minimize_scalar(lambda x: (x - 3) ** 2)\n"
              "round(float(r.x), 4)", "3.0"),
    "scikit-learn": ("from sklearn.linear_model import LinearRegression\nimport numpy as np\n"
                     "X = np.arange(10).reshape(-1, 1)\n"
                     "m = LinearRegression().fit(X, 2 * X.ravel() + 1)\n"
                     "round(float(m.coef_[0]), 6), round(float(m.intercept_), 6)", "(2.0, 1.0)"),
    "scikit-image": ("import numpy as np\nfrom skimage import filters\n"
                     "img = np.zeros((8, 8)); img[:, 4:] = 1\n"
                     "bool(filters.sobel(img)[:, 3:5].min() > 0)", "True"),
    "sympy": ("import sympy as sp\nx = sp.symbols('x')\nsorted(sp.solve(x**2 - 5*x + 6, x))", "[2, 3]"),
    "openpyxl + xlrd": ("import openpyxl, xlrd\n"
                        "wb = openpyxl.Workbook(); wb.active['A1'] = 'hi'; wb.active['B2'] = 42\n"
                        "wb.save('/tmp/t.xlsx')\n"
                        "ws = openpyxl.load_workbook('/tmp/t.xlsx').active\n"
                        "(ws['A1'].value, ws['B2'].value, str(xlrd.xldate.xldate_as_datetime(45000, 0).date()))",
                        "('hi', 42, '2023-03-15')"),
    "pandas reads xlsx": ("import pandas as pd\n"
                          "pd.DataFrame({'n': [1, 2]}).to_excel('/tmp/p.xlsx', index=False)\n"
                          "pd.read_excel('/tmp/p.xlsx')['n'].tolist()", "[1, 2]"),
    "python-docx": ("import docx\nd = docx.Document(); d.add_paragraph('hello docx'); d.save('/tmp/t.docx')\n"
                    "[p.text for p in docx.Document('/tmp/t.docx').paragraphs]", "['hello docx']"),
    "beautifulsoup4": ("from bs4 import BeautifulSoup\n"
                       "[a['href'] for a in BeautifulSoup('<p><a href=\"/x\">x</a><a href=\"/y\">y</a></p>',"
                       " 'html.parser').find_all('a')]", "['/x', '/y']"),
    "requests": ("import http.server, threading, requests\n"
                 "srv = http.server.ThreadingHTTPServer(('127.0.0.1', 0), http.server.SimpleHTTPRequestHandler)\n"
                 "threading.Thread(target=srv.serve_forever, daemon=True).start()\n"
                 "r = requests.get(f'http://127.0.0.1:{srv.server_port}/')\nsrv.shutdown()\nr.status_code", "200"),
    "aiohttp": ("import asyncio\nfrom aiohttp import web, ClientSession\n"
                "async def main():\n"
                "    app = web.Application()\n"
                "    app.router.add_get('/', lambda request: web.Response(text='pong'))\n"
                "    runner = web.AppRunner(app); await runner.setup()\n"
                "    site = web.TCPSite(runner, '127.0.0.1', 0); await site.start()\n"
                "    port = runner.addresses[0][1]\n"
                "    async with ClientSession() as s, s.get(f'http://127.0.0.1:{port}/') as r:\n"
                "        text = await r.text()\n"
                "    await runner.cleanup()\n"
                "    return text\n"
                "asyncio.run(main())", "pong"),
    "tornado": ("import tornado.escape\ntornado.escape.json_decode('{\"a\": 1}')", "{'a': 1}"),
    "nltk": ("from nltk.stem import PorterStemmer\nfrom nltk.tokenize import wordpunct_tokenize\n"
             "[PorterStemmer().stem(w) for w in wordpunct_tokenize('running dogs')]", "['run', 'dog']"),
    "textblob": ("from textblob import TextBlob\nTextBlob('This is a great, wonderful day.').sentiment.polarity > 0",
                 "True"),
    "spacy": ("import spacy\n[t.text for t in spacy.blank('en')('Hello, world!')]", "['Hello', ',', 'world', '!']"),
    "gensim": ("from gensim.models import Word2Vec\n"
               "m = Word2Vec([['cat', 'dog'], ['dog', 'fish']] * 20, vector_size=8, min_count=1, workers=1, seed=1)\n"
               "(m.wv['dog'].shape, 'cat' in m.wv)", "((8,), True)"),
    "xarray": ("import xarray as xr, numpy as np\n"
               "float(xr.DataArray(np.arange(6).reshape(2, 3), dims=('x', 'y')).sum(dim='y').mean())", "7.5"),
    "numba": ("from numba import njit\n@njit\ndef f(n):\n    s = 0\n    for i in range(n):\n        s += i\n    return s\n"
              "f(10)", "45"),
    "joblib": ("from joblib import Parallel, delayed, dump, load\n"
               "dump({'k': 1}, '/tmp/j.pkl')\n"
               "(Parallel(n_jobs=2, backend='threading')(delayed(abs)(-i) for i in range(3)), load('/tmp/j.pkl'))",
               "([0, 1, 2], {'k': 1})"),
    "pytz": ("import pytz, datetime\n"
             "pytz.timezone('Europe/Paris').localize(datetime.datetime(2024, 1, 1, 12)).isoformat()",
             "2024-01-01T12:00:00+01:00"),
    "imageio": ("import imageio.v3 as iio, numpy as np\n"
                "iio.imwrite('/tmp/i.png', np.full((2, 3, 3), 7, dtype=np.uint8))\niio.imread('/tmp/i.png').shape",
                "(2, 3, 3)"),
    "opencv-python": ("import cv2, numpy as np\n"
                      "gray = cv2.cvtColor(np.full((2, 2, 3), 255, dtype=np.uint8), cv2.COLOR_BGR2GRAY)\n"
                      "(gray.shape, int(gray[0, 0]), cv2.imencode('.png', gray)[0])", "((2, 2), 255, True)"),
    "soundfile + librosa": ("import numpy as np, soundfile as sf, librosa\n"
                            "sr = 8000; t = np.arange(sr) / sr\n"
                            "sf.write('/tmp/a.wav', np.sin(2 * np.pi * 440 * t), sr)\n"
                            "y, sr2 = librosa.load('/tmp/a.wav', sr=None)\n"
                            "spectrum = np.abs(librosa.stft(y, n_fft=2048)).mean(axis=1)\n"
                            "peak = librosa.fft_frequencies(sr=sr2, n_fft=2048)[spectrum.argmax()]\n"
                            "(sr2, bool(abs(peak - 440) < 5))", "(8000, True)"),
    "bokeh": ("from bokeh.plotting import figure\nfrom bokeh.embed import file_html\nfrom bokeh.resources import INLINE\n"
              "p = figure(title='b'); p.line([1, 2], [3, 4])\n'Bokeh' in file_html(p, INLINE, 'page')", "True"),
    "kaleido (import only: needs a Chrome)": ("import kaleido\nbool(kaleido.__name__)", "True"),
}  # fmt: skip


@pytest.fixture(scope="module")
def code(e2b_env: str) -> Iterator[Sandbox]:
    s = Sandbox.create(timeout=600)
    yield s
    s.kill()


@pytest.mark.parametrize("package", list(CASES))
def test_package_does_a_real_thing(code: Sandbox, package: str) -> None:
    cell, expected = CASES[package]
    context = code.create_code_context()  # its own process: no package sees another's imports
    try:
        ex = code.run_code(cell, context=context, timeout=240)
    finally:
        code.remove_code_context(context)
    assert ex.error is None, f"{ex.error.name}: {ex.error.value}\n{ex.error.traceback}"
    assert ex.text == expected, (ex.text, ex.logs)


def test_seaborn_plot_is_a_chart_and_png(code: Sandbox) -> None:
    ex = code.run_code("import seaborn as sns, pandas as pd, matplotlib.pyplot as plt\n"
                       "df = pd.DataFrame({'x': [1, 2, 3, 4], 'y': [2, 4, 1, 3]})\n"
                       "sns.scatterplot(data=df, x='x', y='y')\nplt.title('sea')\nplt.show()\n"
                       "sns.barplot(x=['a', 'b'], y=[1, 2])\nplt.show()")  # fmt: skip
    assert ex.error is None, ex.error
    scatter, bar = ex.results
    assert isinstance(scatter.chart, ScatterChart) and scatter.chart.title == "sea"
    assert scatter.chart.x_label == "x" and len(scatter.chart.elements[0].points) == 4
    assert isinstance(bar.chart, BarChart)
    for r in ex.results:
        assert base64.b64decode(r.png).startswith(b"\x89PNG")


def test_plotly_figure_is_a_result(code: Sandbox) -> None:
    ex = code.run_code("import plotly.express as px\nfig = px.bar(x=['a', 'b'], y=[1, 2], title='pl')\nfig")
    assert ex.error is None, ex.error
    figures = [r for r in ex.results if r.extra and "application/vnd.plotly.v1+json" in r.extra]
    assert len(figures) == 1  # as in E2B's Jupyter: plotly's own mime type (in extra) and its HTML
    spec = figures[0].extra["application/vnd.plotly.v1+json"]
    assert spec["layout"]["title"]["text"] == "pl" and spec["data"][0]["type"] == "bar"
    assert "plotly" in (figures[0].html or "").lower()
