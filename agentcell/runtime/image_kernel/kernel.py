"""A Python code context on a template image's own interpreter (kernel_image_python.py starts it).

Standalone on purpose: it runs on the image's python3 (any CPython >= 3.8), which has neither
agentcell nor IPython, so it uses only the standard library and must not import agentcell. It speaks
the protocol of every exec'd kernel (kernel_exec.py): requests on fd 3 in the agent framing
(``u32 header_len | u32 payload_len | JSON header | payload``), one ``{"line": true}`` frame per E2B
line, ``{"done": true}`` at the end of a run, ``{"warm": true}`` once at the start; fds 1 and 2 are the
run's stdout and stderr. What it sends is what the forked IPython context sends for the same code
(kernel.py, display.py): results with their mime fields, IPython-style tracebacks, the execution
count, ``!cmd`` and the common magics (%pip, %cd, %env, %pwd, %%writefile, %%bash ...).
"""

import ast
import base64
import builtins
import datetime
import io
import json
import linecache
import math
import numbers
import os
import re
import shlex
import signal
import site
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
import types

CTRL_FD = 3
PREFIX = struct.Struct(">II")
MAX_HEADER = 1 << 20
MAX_PAYLOAD = 64 << 20
MAX_LINE = 32 << 20  # kernel.MAX_LINE: the largest single output line
FLUSH_DELAY = 0.01  # stdio.FLUSH_DELAY
CO_COROUTINE = 0x0080
TOP_LEVEL_AWAIT = getattr(ast, "PyCF_ALLOW_TOP_LEVEL_AWAIT", 0)
_HERE = os.path.dirname(os.path.abspath(__file__))
_RUNTIME_LIB = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))  # the dir holding agentcell/


# --------------------------------------------------------------------------------------------------
# The interpreter as a user's script would see it
# --------------------------------------------------------------------------------------------------

def _clean_sys_path():
    """'' first (the cwd, as IPython and `python -c`; not with -P/PYTHONSAFEPATH), not this
    script's directory; nothing of the runtime even if a PYTHONPATH named it."""
    ours = (os.path.realpath(_RUNTIME_LIB), os.path.realpath(_HERE))
    keep = [e for e in sys.path if not (e and os.path.realpath(e) in ours)]
    if not getattr(sys.flags, "safe_path", False) and "" not in keep:
        keep.insert(0, "")
    sys.path[:] = keep


_seen_pth = set()


def _site_dirs():
    dirs = []
    try:
        dirs.extend(site.getsitepackages())
    except AttributeError:  # an old virtualenv's site.py
        pass
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return dirs


def _note_pth_files():
    for d in _site_dirs():
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            if name.endswith(".pth"):
                _seen_pth.add(os.path.join(d, name))


_site_state = None


def _site_stamp():
    stamp = []
    for d in _site_dirs():
        try:
            stamp.append((d, os.stat(d).st_mtime_ns))
        except OSError:
            stamp.append((d, None))
    return stamp


def refresh_site():
    """What a `pip install` since the last run added: the user site directory (pip falls back to
    ~/.local when site-packages is not writable; site.py adds it only if it existed at start), new
    .pth files (editable installs), and the import system's directory caches. A stat per site
    directory when nothing changed."""
    global _site_state
    stamp = _site_stamp()
    if stamp == _site_state:
        return
    _site_state = stamp
    known = set(p for p in sys.path)
    system_dirs = [d for d in _site_dirs()[:-1] if d in known] if site.ENABLE_USER_SITE else []
    for d in _site_dirs():
        if not os.path.isdir(d):
            continue
        if d not in known:
            if site.ENABLE_USER_SITE and d == site.getusersitepackages() and system_dirs:
                sys.path.insert(sys.path.index(system_dirs[0]), d)  # as site.py orders them
            else:
                sys.path.append(d)
            known.add(d)
        try:
            names = sorted(os.listdir(d))
        except OSError:
            continue
        for name in names:
            path = os.path.join(d, name)
            if name.endswith(".pth") and path not in _seen_pth:
                _seen_pth.add(path)
                try:
                    site.addpackage(d, name, known)
                except Exception:
                    pass
    import importlib
    importlib.invalidate_caches()


# --------------------------------------------------------------------------------------------------
# Frames (protocol.py's codec) and stdio
# --------------------------------------------------------------------------------------------------

def encode_frame(header, payload=b""):
    head = json.dumps(header, separators=(",", ":")).encode()
    return PREFIX.pack(len(head), len(payload)) + head + payload


def recv_exact(sock, n):
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except InterruptedError:
            continue
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def recv_frame(sock):
    """(header, payload), or None at the end of the stream or on a malformed frame."""
    prefix = recv_exact(sock, PREFIX.size)
    if prefix is None:
        return None
    head_len, payload_len = PREFIX.unpack(prefix)
    if head_len > MAX_HEADER or payload_len > MAX_PAYLOAD:
        return None
    head = recv_exact(sock, head_len)
    payload = recv_exact(sock, payload_len) if payload_len else b""
    if head is None or payload is None:
        return None
    try:
        header = json.loads(head.decode())
    except ValueError:
        return None
    return (header, payload) if isinstance(header, dict) else None


class _Flusher(object):
    """stdio.py: text printed without a newline goes out within FLUSH_DELAY."""

    def __init__(self):
        self.streams = []
        self.pending = False
        self._wake = None

    def kick(self):
        if self._wake is None:
            self._wake = threading.Event()
            t = threading.Thread(target=self._run, name="agentcell-stdio-flush")
            t.daemon = True
            t.start()
        self.pending = True
        self._wake.set()

    def _run(self):
        while True:
            self._wake.wait()
            time.sleep(FLUSH_DELAY)
            self._wake.clear()
            self.pending = False
            for stream in self.streams:
                try:
                    stream.flush()
                except Exception:
                    pass


_flusher = _Flusher()


class PromptStream(io.TextIOWrapper):
    def write(self, s, _write=io.TextIOWrapper.write):
        n = _write(self, s)
        if s[-1:] != "\n" and not _flusher.pending:
            _flusher.kick()
        return n


def _open_stream(fd):
    stream = PromptStream(open(fd, "wb", closefd=False), encoding="utf-8", errors="backslashreplace",
                          line_buffering=True)
    _flusher.streams.append(stream)
    return stream


def install_stdio():
    sys.stdout = sys.__stdout__ = _open_stream(1)
    sys.stderr = sys.__stderr__ = _open_stream(2)


def flush_stdio():
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            pass


# --------------------------------------------------------------------------------------------------
# E2B lines (display.py)
# --------------------------------------------------------------------------------------------------

MIME_FIELDS = {
    "text/plain": "text", "text/html": "html", "text/markdown": "markdown", "image/svg+xml": "svg",
    "image/png": "png", "image/jpeg": "jpeg", "application/pdf": "pdf", "text/latex": "latex",
    "application/json": "json", "application/javascript": "javascript", "e2b/data": "data",
    "e2b/chart": "chart",
}
_BINARY = ("png", "jpeg", "pdf")
_REPR_METHODS = (
    ("text/html", "_repr_html_"), ("text/markdown", "_repr_markdown_"), ("image/svg+xml", "_repr_svg_"),
    ("image/png", "_repr_png_"), ("image/jpeg", "_repr_jpeg_"), ("text/latex", "_repr_latex_"),
    ("application/json", "_repr_json_"), ("application/javascript", "_repr_javascript_"),
    ("application/pdf", "_repr_pdf_"),
)


def _json_default(obj):
    """What json cannot encode by itself, as display._json_default."""
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        return float(obj)
    if isinstance(obj, (datetime.date, datetime.time)):
        return obj.isoformat()
    if isinstance(obj, (bytes, bytearray)):
        return base64.b64encode(obj).decode()
    tolist = getattr(obj, "tolist", None)
    if callable(tolist):
        try:
            return tolist()
        except Exception:
            pass
    return repr(obj)


def _finite(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return dict((k, _finite(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    if not isinstance(obj, (str, int, bool, type(None))):
        converted = _json_default(obj)
        return converted if isinstance(converted, str) else _finite(converted)
    return obj


def encode_line(line):
    try:
        return json.dumps(line, separators=(",", ":"), default=_json_default, allow_nan=False).encode()
    except ValueError:
        return json.dumps(_finite(line), separators=(",", ":"), default=_json_default, allow_nan=False).encode()


def result_line(data, is_main_result):
    line = {"type": "result"}
    extra = {}
    for mime, value in data.items():
        key = MIME_FIELDS.get(mime)
        if isinstance(value, (bytes, bytearray)):
            value = base64.b64encode(value).decode() if key in _BINARY or key is None else value.decode()
        if value is None:
            continue
        if key is None:
            extra[mime] = value
        else:
            line[key] = value
    text = line.get("text")
    if isinstance(text, str) and len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        line["text"] = text[1:-1]
    line["extra"] = extra
    line["is_main_result"] = is_main_result
    return line


# --------------------------------------------------------------------------------------------------
# Formatting an object into a mime bundle (IPython's formatters, E2B's additions)
# --------------------------------------------------------------------------------------------------

try:
    from _sha1 import sha1  # what hashlib would give, without loading OpenSSL at every start
except ImportError:
    from hashlib import sha1

_pretty = None


def _pretty_printer():
    """IPython's text/plain, near enough: wrapped at 79 columns, dicts in insertion order, strings
    never split into pieces. (pprint imports dataclasses and inspect: loaded on first need.)"""
    global _pretty
    if _pretty is None:
        import pprint

        class Pretty(pprint.PrettyPrinter):
            _dispatch = dict(pprint.PrettyPrinter._dispatch)
            for _t in (str, bytes, bytearray):
                _dispatch.pop(_t.__repr__, None)

        _pretty = Pretty(width=79, sort_dicts=False)
    return _pretty


def _plain(obj):
    if isinstance(obj, type):
        mod = getattr(obj, "__module__", None)
        name = getattr(obj, "__qualname__", obj.__name__)
        return name if mod in (None, "builtins") else "%s.%s" % (mod, name)
    if type(obj).__name__ == "function" and hasattr(obj, "__code__"):
        import inspect
        mod = getattr(obj, "__module__", None)
        name = getattr(obj, "__qualname__", obj.__name__)
        if mod and mod != "builtins":
            name = "%s.%s" % (mod, name)
        try:
            name += str(inspect.signature(obj))
        except (ValueError, TypeError):
            pass
        return "<function %s>" % name
    if type(obj).__repr__ is object.__repr__:  # IPython's default: no "object" in it
        klass = type(obj)
        return "<%s.%s at 0x%x>" % (klass.__module__, getattr(klass, "__qualname__", klass.__name__), id(obj))
    if isinstance(obj, (list, tuple, dict, set, frozenset)):
        return _pretty_printer().pformat(obj)
    return repr(obj)


def _json_of(obj):
    """A list or dict as JSON (E2B: orjson with numpy values and non-string keys), or None."""
    def default(o):
        if isinstance(o, (datetime.date, datetime.time, datetime.datetime)):
            return o.isoformat()
        if type(o).__module__ == "numpy" or type(o).__module__.startswith("numpy."):
            return o.tolist()
        raise TypeError("not JSON")
    try:
        return json.loads(json.dumps(obj, default=default))
    except (TypeError, ValueError, RecursionError):
        return None


def _figure_png(fig):
    buf = io.BytesIO()
    fig.canvas.print_figure(buf, format="png", bbox_inches="tight")
    return buf.getvalue()


formatter_error_hook = None  # set by the kernel: a failing _repr_*_ is an error line, as in IPython


def _formatter_error():
    if formatter_error_hook is not None:
        formatter_error_hook(*sys.exc_info())
    else:
        traceback.print_exc()


def _chart(fig):
    """E2B's chart dict of a figure, when the image has E2B's e2b_charts (it needs pydantic, so it
    cannot come with this script); {} for a figure it cannot read, as E2B."""
    try:
        from e2b_charts import chart_figure_to_dict
    except Exception:
        return None
    try:
        return chart_figure_to_dict(fig)
    except Exception:
        return {}


def format_bundle(obj):
    """The mime bundle of `obj`, as IPython's display formatter makes it."""
    data = {}
    mimebundle = getattr(obj, "_repr_mimebundle_", None)
    if callable(mimebundle) and not isinstance(obj, type):
        try:
            got = mimebundle()
            if isinstance(got, tuple):
                got = got[0]
            if isinstance(got, dict):
                data.update(got)
        except Exception:
            _formatter_error()
    for mime, method in _REPR_METHODS:
        if mime in data or isinstance(obj, type):
            continue
        fn = getattr(obj, method, None)
        if not callable(fn):
            continue
        try:
            value = fn()
        except Exception:
            _formatter_error()
            continue
        if isinstance(value, tuple) and len(value) == 2:
            value = value[0]
        if value is not None:
            data[mime] = value
    figure_module = sys.modules.get("matplotlib.figure")
    if figure_module is not None and isinstance(obj, figure_module.Figure):
        if "image/png" not in data:
            try:
                data["image/png"] = _figure_png(obj)
            except Exception:
                _formatter_error()
        chart = _chart(obj)
        if chart is not None:
            data["e2b/chart"] = chart
    if isinstance(obj, (list, dict)) and "application/json" not in data:
        value = _json_of(obj)
        if value is not None:
            data["application/json"] = value
    pandas = sys.modules.get("pandas")
    if pandas is not None and isinstance(obj, pandas.DataFrame):
        try:
            table = obj.to_dict(orient="list")
            for key, values in table.items():
                table[key] = [v.isoformat() if isinstance(v, pandas.Timestamp) else v for v in values]
            data["e2b/data"] = table
        except Exception:
            pass
    if "text/plain" not in data:
        data["text/plain"] = _plain(obj)
    # IPython's order: text/plain first, as the E2B line's fields come
    return dict([("text/plain", data.pop("text/plain"))] + list(data.items()))


# --------------------------------------------------------------------------------------------------
# Tracebacks, in IPython's "Context" mode without colours
# --------------------------------------------------------------------------------------------------

_CELL_NAME = re.compile(r"<ipython-input-(\d+)-[0-9a-f]+>\Z")
_HOME = os.path.expanduser("~")


def _where(filename, lineno):
    m = _CELL_NAME.match(filename)
    if m:
        return "Cell In[%s], line %d" % (m.group(1), lineno)
    if _HOME and _HOME != "/" and filename.startswith(_HOME + "/"):
        filename = "~" + filename[len(_HOME):]
    return "File %s:%d" % (filename, lineno)


def _call(frame):
    code = frame.f_code
    name = getattr(code, "co_qualname", code.co_name)
    if name == "<module>":
        return ""
    import inspect
    try:
        args, varargs, varkw, local_vars = inspect.getargvalues(frame)
        return ", in %s%s" % (name, inspect.formatargvalues(args, varargs, varkw, local_vars,
                                                              formatvalue=lambda v: ""))
    except Exception:
        return ", in %s(***failed resolving arguments***)" % name


def _code_lines(code):
    """The lines of `code` (a function's: its body, not its module's)."""
    lines = set()
    stack = [code]
    while stack:
        c = stack.pop()
        if hasattr(c, "co_lines"):
            lines.update(ln for _, _, ln in c.co_lines() if ln is not None)
        else:
            import dis
            lines.update(ln for _, ln in dis.findlinestarts(c))
        lines.add(c.co_firstlineno)
        stack.extend(k for k in c.co_consts if hasattr(k, "co_code"))
    return lines


def _frame_text(frame, filename, lineno):
    out = [_where(filename, lineno) + _call(frame)]
    lines = linecache.getlines(filename, frame.f_globals)
    if lines:
        if frame.f_code.co_name == "<module>":
            lo, hi = 1, len(lines)
        else:
            scope = _code_lines(frame.f_code)
            lo, hi = min(scope), max(scope)
        shown = []
        n = lineno - 1
        while n >= lo and len(shown) < 2:
            if lines[n - 1].strip():
                shown.insert(0, n)
            n -= 1
        shown.append(lineno)
        n, after = lineno + 1, 0
        while n <= min(hi, len(lines)) and after < 2:
            if lines[n - 1].strip():
                shown.append(n)
                after += 1
            n += 1
        # IPython (stack_data) shows the lines dedented by their common indentation
        indents = [len(lines[n - 1]) - len(lines[n - 1].lstrip()) for n in shown
                   if n <= len(lines) and lines[n - 1].strip()]
        dedent = min(indents) if indents else 0
        for n in shown:  # IPython: the number right-aligned in 7 columns, "---> " before the failing one
            text = lines[n - 1].rstrip("\n")[dedent:] if n <= len(lines) else ""
            num = str(n)
            prefix = ("-" * max(7 - len(num) - 2, 0) + "> " + num) if n == lineno else num.rjust(7)
            out.append("%s %s" % (prefix, text))
    return "\n".join(out) + "\n"


def _exception_only(etype, value):
    if isinstance(value, SyntaxError):
        return "".join(traceback.format_exception_only(etype, value)).rstrip("\n")
    try:
        text = str(value)
    except Exception:
        text = "<exception str() failed>"
    lines = ["%s: %s" % (etype.__name__, text)]
    notes = getattr(value, "__notes__", None)
    if isinstance(notes, (list, tuple)):
        lines.extend(str(n) for n in notes)
    return "\n".join(lines)


def _collapse(entries):
    """stack_data's collapse_repeated: frames whose (code, line) occurs more than 3 times in the
    stack are shown at their first, second and last occurrence of a run; the rest of the run
    becomes one ``[... skipping similar frames: ...]`` line. Entries: (tb, key); yields tb or a
    list of (tb, key) collapsed."""
    counts = {}
    for _, key in entries:
        counts[key] = counts.get(key, 0) + 1
    marked = []  # (entry, shown)
    i = 0
    while i < len(entries):
        common = counts[entries[i][1]] > 3
        j = i
        while j < len(entries) and (counts[entries[j][1]] > 3) == common:
            j += 1
        group = entries[i:j]
        if not common:
            marked.extend((e, True) for e in group)
        else:
            keys = [k for _, k in group]
            shown = [False] * len(group)
            for key in set(keys):
                first = keys.index(key)
                shown[first] = True
                if key in keys[first + 1:]:
                    shown[keys.index(key, first + 1)] = True
                shown[len(keys) - 1 - keys[::-1].index(key)] = True
            marked.extend((group[k], shown[k]) for k in range(len(group)))
        i = j
    run = []
    for entry, shown in marked:
        if shown:
            if run:
                yield run
                run = []
            yield entry[0]
        else:
            run.append(entry)
    if run:
        yield run


def _skipped(run):
    counts = {}
    for _, key in run:
        counts[key] = counts.get(key, 0) + 1
    ordered = sorted(counts.items(), key=lambda item: (-item[1], item[0][0].co_name))
    return "    [... skipping similar frames: %s]\n" % ", ".join(
        "%s at line %d (%d times)" % (code.co_name, line, n) for (code, line), n in ordered)


def _one_exception(etype, value, tb):
    head = "%s%s" % (etype.__name__.ljust(42), "Traceback (most recent call last)")
    parts = [head]
    entries = []
    while tb is not None:
        entries.append((tb, (tb.tb_frame.f_code, tb.tb_lineno)))
        tb = tb.tb_next
    for item in _collapse(entries):
        if isinstance(item, list):
            parts.append(_skipped(item))
        else:
            parts.append(_frame_text(item.tb_frame, item.tb_frame.f_code.co_filename, item.tb_lineno))
    parts.append(_exception_only(etype, value))
    return "\n".join(parts)


def format_traceback(etype, value, tb):
    """IPython's structured traceback, joined: chained exceptions first, each with its frames."""
    chain = []
    seen = set()
    cur, how = value, None
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        chain.append((cur, how))
        if cur.__cause__ is not None:
            cur, how = cur.__cause__, "\nThe above exception was the direct cause of the following exception:\n"
        elif cur.__context__ is not None and not cur.__suppress_context__:
            cur, how = cur.__context__, "\nDuring handling of the above exception, another exception occurred:\n"
        else:
            cur = None
    chain.reverse()
    blocks = ["-" * 75]
    for i, (exc, _) in enumerate(chain):
        exc_tb = tb if i == len(chain) - 1 else exc.__traceback__
        blocks.append(_one_exception(type(exc), exc, exc_tb))
        if i + 1 < len(chain):
            blocks.append(chain[i][1])  # how this one led to the next
    return "\n".join(blocks)


def format_syntax_error(value, count):
    text = "".join(traceback.format_exception_only(type(value), value))
    lines = text.splitlines(True)
    if lines and lines[0].lstrip().startswith("File "):
        lines[0] = "  Cell In[%d], line %s\n" % (count, value.lineno)
    return "".join(lines)


# --------------------------------------------------------------------------------------------------
# Shell escapes and magics
# --------------------------------------------------------------------------------------------------

class UsageError(Exception):
    """A magic misused or unknown: printed to stderr, as IPython does, not an error line."""


_VAR = re.compile(r"(\$\$)|\$([A-Za-z_][A-Za-z0-9_]*)|\{([^{}]+)\}")


def expand(cmd, ns):
    """IPython's variable expansion of a shell command: $name, {expression}, $$ for a $."""
    def sub(m):
        if m.group(1):
            return "$"
        if m.group(2):
            name = m.group(2)
            return str(ns[name]) if name in ns else m.group(0)
        try:
            return str(eval(m.group(3), ns))
        except Exception:
            return m.group(0)
    return _VAR.sub(sub, cmd)


def _wait(proc):
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(1)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise


def system(cmd, capture=False):
    """`!cmd`: run by /bin/sh, its output streamed (or, for `x = !cmd`, returned as a list of lines)."""
    flush_stdio()
    proc = subprocess.Popen(cmd, shell=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE if capture else None)
    if capture:
        try:
            out = proc.communicate()[0]
        except KeyboardInterrupt:
            proc.kill()
            proc.wait()
            raise
        return out.decode("utf-8", "replace").splitlines()
    _wait(proc)
    return None


def _pip(line):
    flush_stdio()
    argv = [sys.executable, "-m", "pip"] + shlex.split(line)
    _wait(subprocess.Popen(argv, stdin=subprocess.DEVNULL))
    print("Note: you may need to restart the kernel to use updated packages.")
    refresh_site()


def _cd(line):
    path = os.path.expanduser(line.strip().strip("'\"") or "~")
    try:
        os.chdir(path)
    except OSError as e:
        print("[Errno %s] %s: %r" % (e.errno, e.strerror, path), file=sys.stderr)
        return
    print(os.getcwd())


def _env(line):
    line = line.strip()
    if not line:
        return dict(os.environ)
    if "=" in line or " " in line:
        sep = "=" if "=" in line and (" " not in line or line.index("=") < line.index(" ")) else " "
        name, value = line.split(sep, 1)
        name, value = name.strip(), value.strip()
        os.environ[name] = value
        print("env: %s=%s" % (name, value))
        return None
    if line not in os.environ:
        raise UsageError("Environment does not have key: %s" % line)
    return os.environ[line]


def _time_line(line, ns):
    """%time / %%time, printed as IPython prints them."""
    try:
        code, mode = compile(line, "<timed eval>", "eval"), "eval"
    except SyntaxError:
        code, mode = compile(line, "<timed exec>", "exec"), "exec"
    start, before = time.perf_counter(), os.times()
    try:
        result = eval(code, ns) if mode == "eval" else exec(code, ns)
    finally:
        after, wall = os.times(), time.perf_counter() - start
        user, sys_ = after.user - before.user, after.system - before.system
        print("CPU times: user %s, sys: %s, total: %s\nWall time: %s"
              % (_fmt_time(user), _fmt_time(sys_), _fmt_time(user + sys_), _fmt_time(wall)))
    return result


def _fmt_time(s):
    for unit, scale in (("s", 1.0), ("ms", 1e3), ("µs", 1e6), ("ns", 1e9)):
        if s * scale >= 1 or unit == "ns":
            return "%.3g %s" % (s * scale, unit)
    return "%.3g s" % s


class Magics(object):
    def __init__(self, kernel):
        self.kernel = kernel

    def line(self, name, arg):
        ns = self.kernel.ns
        if name == "pip":
            return _pip(expand(arg, ns))
        if name == "cd":
            return _cd(expand(arg, ns))
        if name == "pwd":
            return os.getcwd()
        if name in ("env", "set_env"):
            return _env(expand(arg, ns))
        if name == "time":
            return _time_line(arg, ns)
        if name == "matplotlib":  # figures are always shown inline here
            return None
        if name in ("sx", "system"):
            return system(expand(arg, ns), capture=True)
        if name == "who":
            print("\t".join(sorted(k for k in ns if not k.startswith("_") and k not in self.kernel.builtin_names)))
            return None
        raise UsageError("Line magic function `%%%s` not found." % name)

    def cell(self, name, arg, body):
        ns = self.kernel.ns
        if name in ("bash", "sh"):
            flush_stdio()
            proc = subprocess.Popen(["bash" if name == "bash" else "sh"], stdin=subprocess.PIPE)
            try:
                proc.communicate(body.encode())
            except KeyboardInterrupt:
                proc.kill()
                proc.wait()
                raise
            return None
        if name == "writefile":
            words = shlex.split(expand(arg, ns))
            append = "-a" in words or "--append" in words
            path = [w for w in words if not w.startswith("-")]
            if not path:
                raise UsageError("%%writefile needs a file name")
            target = os.path.expanduser(path[0])
            print("%s %s" % ("Appending to" if append and os.path.exists(target) else
                             "Overwriting" if os.path.exists(target) else "Writing", path[0]))
            with open(target, "a" if append else "w") as f:
                f.write(body)
            return None
        if name == "time":
            return _time_line(body, ns)
        if name == "capture":
            words = arg.split()
            target = next((w for w in words if not w.startswith("-")), None)
            captured = self.kernel.run_captured(body, "--no-stdout" not in words, "--no-stderr" not in words)
            if target:
                self.kernel.ns[target] = captured
            return None
        raise UsageError("Cell magic `%%%%%s` not found." % name)


_LINE_MAGIC = re.compile(r"^(\s*)(?:([A-Za-z_][\w.]*(?:\s*,\s*[A-Za-z_][\w.]*)*)\s*=\s*)?(!!?|%)(.*)$")


def transform(source):
    """Source with IPython syntax (!cmd, %magic, x = !cmd, %%cell magic) as plain Python. Only called
    for source that is not valid Python as it is."""
    lines = source.splitlines()
    if lines and lines[0].startswith("%%"):
        head = lines[0][2:].split(None, 1)
        name, arg = (head + ["", ""])[:2] if head else ("", "")
        body = "\n".join(lines[1:]) + ("\n" if len(lines) > 1 else "")
        return "__agentcell__.cell_magic(%r, %r, %r)\n" % (name, arg, body)
    out = []
    cont = ""
    for line in lines:
        full = cont + line
        if full.endswith("\\") and _LINE_MAGIC.match(full):
            cont = full[:-1]
            continue
        cont = ""
        m = _LINE_MAGIC.match(full)
        if not m or (m.group(3) == "%" and m.group(4)[:1] in ("=", " ", "%")):
            out.append(line)
            continue
        indent, target, kind, rest = m.groups()
        if kind in ("!", "!!"):
            call = "__agentcell__.system(__agentcell__.expand(%r), capture=%r)" % (rest, bool(target))
        else:
            name, _, arg = rest.partition(" ")
            call = "__agentcell__.line_magic(%r, %r)" % (name, arg)
        out.append("%s%s%s" % (indent, (target + " = ") if target else "", call))
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------------------------------
# Matplotlib: figures as PNG results, as the inline backend shows them
# --------------------------------------------------------------------------------------------------

class _MatplotlibHook(object):
    """Patches pyplot when user code imports it: the Agg backend, show() displays the open figures."""

    def __init__(self, kernel):
        self.kernel = kernel

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in ("matplotlib", "matplotlib.pyplot"):
            return None
        import importlib.util
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        hook = self

        class Loader(object):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                hook.patch(fullname, module)

            def __getattr__(self, name):
                return getattr(loader, name)

        spec.loader = Loader()
        return spec

    def patch(self, fullname, module):
        if fullname == "matplotlib":
            try:
                module.use("agg")  # no display in a sandbox; the env's MPLBACKEND may name another
            except Exception:
                pass
            return
        kernel = self.kernel

        def show(*args, **kwargs):
            kernel.flush_figures()

        module.show = show


# --------------------------------------------------------------------------------------------------
# The kernel
# --------------------------------------------------------------------------------------------------

class CapturedIO(object):
    """What %%capture NAME keeps, like IPython's: .stdout, .stderr, .outputs, .show()."""

    def __init__(self, kernel):
        self._kernel = kernel
        self._out, self._err = io.StringIO(), io.StringIO()
        self.outputs = []

    @property
    def stdout(self):
        return self._out.getvalue()

    @property
    def stderr(self):
        return self._err.getvalue()

    def show(self):
        sys.stdout.write(self.stdout)
        sys.stderr.write(self.stderr)
        for line in self.outputs:
            self._kernel.send_line(line)

    __call__ = show


class _Shell(object):
    """The little of IPython's shell object notebook code uses through get_ipython()."""

    def __init__(self, kernel):
        self.user_ns = kernel.ns
        self.execution_count = kernel.count
        self.run_line_magic = kernel.line_magic
        self.run_cell_magic = kernel.cell_magic
        self.system = lambda cmd: system(expand(cmd, kernel.ns))

    def getoutput(self, cmd):
        return system(expand(cmd, self.user_ns), capture=True)


class Kernel(object):
    def __init__(self, sock):
        self.sock = sock
        self.count = 1
        self.running = False
        self.interrupt_pending = False
        self.held = b""  # the main result's frame, sent with the next frame (kernel._send_line)
        self.loop = None  # for cells with top-level await
        # user code gets a __main__ of its own (this script's globals stay out of its reach); it is
        # sys.modules["__main__"], so pickle finds the classes it defines
        self.user_module = types.ModuleType("__main__")
        sys.modules["__main__"] = self.user_module
        self.ns = self.user_module.__dict__
        self.ns.update({"__builtins__": builtins, "In": [""], "Out": {},
                        "_": "", "__": "", "___": "", "_i": "", "_ii": "", "_iii": ""})
        self.ns["__agentcell__"] = self
        self.builtin_names = set(self.ns)
        builtins.display = self.display
        global formatter_error_hook
        formatter_error_hook = self.send_error
        builtins.get_ipython = lambda: _Shell(self)  # for code that calls get_ipython().run_line_magic(...)
        self.magics = Magics(self)
        self.capturing = None
        sys.meta_path.insert(0, _MatplotlibHook(self))

    # frames ------------------------------------------------------------------------------------
    def _defer_sigint(self, signum, frame):
        self.interrupt_pending = True

    def send(self, header, payload=b""):
        running = self.running
        if running:
            signal.signal(signal.SIGINT, self._defer_sigint)
        try:
            flush_stdio()
            data, self.held = self.held + encode_frame(header, payload), b""
            self.sock.sendall(data)
        finally:
            if running:
                signal.signal(signal.SIGINT, signal.default_int_handler)
        if running and self.interrupt_pending:
            self.interrupt_pending = False
            raise KeyboardInterrupt

    def send_line(self, line):
        if self.capturing is not None and line.get("type") == "result":
            self.capturing.append(line)
            return
        data = encode_line(line)
        if len(data) > MAX_LINE:
            what = line.get("type", "output")
            data = encode_line({"type": "error", "name": "OutputTooLarge",
                                "value": "a %s of %d bytes is over the %d MiB limit of one output; write it "
                                         "to a file and read it with files.read" % (what, len(data), MAX_LINE >> 20),
                                "traceback": ""})
        if line.get("is_main_result") is True:
            self.held += encode_frame({"line": True, "hold": True}, data)
            return
        hold = line.get("type") == "number_of_executions"
        self.send({"line": True, "hold": True} if hold else {"line": True}, data)

    def send_error(self, etype, value, tb):
        tb = _user_frames(tb)
        try:
            text = format_traceback(etype, value, tb)
        except Exception:
            text = "".join(traceback.format_exception(etype, value, tb))
        try:
            text_value = str(value)
        except Exception:
            text_value = "<exception str() failed>"
        self.send_line({"type": "error", "name": etype.__name__, "value": text_value, "traceback": text})

    # user-facing helpers -----------------------------------------------------------------------
    def display(self, *objs, **kwargs):
        for obj in objs:
            self.send_line(result_line(format_bundle(obj), False))

    def expand(self, cmd):
        return expand(cmd, self.ns)

    def system(self, cmd, capture=False):
        return system(cmd, capture)

    def line_magic(self, name, arg):
        return self.magics.line(name, arg)

    def cell_magic(self, name, arg, body):
        return self.magics.cell(name, arg, body)

    def flush_figures(self):
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is None:
            return
        try:
            numbers = pyplot.get_fignums()
        except Exception:
            return
        for n in numbers:
            fig = pyplot.figure(n)
            try:
                self.display(fig)
            finally:
                pyplot.close(fig)

    # running code --------------------------------------------------------------------------------
    def compile_cell(self, source, count):
        name = "<ipython-input-%d-%s>" % (count, sha1(source.encode("utf-8", "surrogatepass")).hexdigest()[:12])
        try:
            tree = ast.parse(source, name, "exec")
        except SyntaxError:
            transformed = transform(source)
            if transformed == source:
                raise
            try:
                tree = ast.parse(transformed, name, "exec")
            except SyntaxError:
                ast.parse(source, name, "exec")  # the user's own error, not one of the transform
                raise
        linecache.cache[name] = (len(source), None, source.splitlines(True), name)
        return tree, name

    def _exec(self, node, name, mode):
        code = compile(node, name, mode, flags=TOP_LEVEL_AWAIT, dont_inherit=True)
        result = eval(code, self.ns)
        if code.co_flags & CO_COROUTINE:
            if self.loop is None:
                import asyncio  # ~60 ms to import: only for a cell with top-level await
                self.loop = asyncio.new_event_loop()
            result = self.loop.run_until_complete(result)
        return result

    def run_captured(self, source, stdout=True, stderr=True):
        """%%capture: run `source` with its prints and displays kept (output of subprocesses, written
        to the fds themselves, is not: as in IPython)."""
        tree = ast.parse(source, "<cell>", "exec")
        captured = CapturedIO(self)
        saved = (self.capturing, sys.stdout, sys.stderr)
        self.capturing = captured.outputs
        if stdout:
            sys.stdout = captured._out
        if stderr:
            sys.stderr = captured._err
        try:
            for node in tree.body:
                self._exec(ast.Module([node], []), "<cell>", "exec")
        finally:
            self.capturing, sys.stdout, sys.stderr = saved
        return captured

    def run_cell(self, source, count):
        if not source.endswith("\n"):
            source += "\n"
        source = _leading_indent(source)
        try:
            tree, name = self.compile_cell(source, count)
        except (SyntaxError, ValueError, OverflowError) as e:
            if isinstance(e, SyntaxError):
                self.send_line({"type": "error", "name": type(e).__name__, "value": str(e),
                                "traceback": format_syntax_error(e, count)})
            else:
                self.send_line({"type": "error", "name": type(e).__name__, "value": str(e), "traceback": ""})
            return
        self.ns["In"].append(source)
        self.ns["_iii"], self.ns["_ii"], self.ns["_i"] = self.ns["_ii"], self.ns["_i"], source
        self.ns["_i%d" % count] = source
        body = tree.body
        last = body[-1] if body and isinstance(body[-1], ast.Expr) and not _ends_with_semicolon(source) else None
        if last is not None:
            body = body[:-1]
        try:
            for node in body:
                self._exec(ast.Module([node], []), name, "exec")
            if last is not None:
                value = self._exec(ast.Expression(last.value), name, "eval")
                if value is not None:
                    self.set_result(value, count)
        except SystemExit as e:
            self.send_line({"type": "error", "name": "SystemExit", "value": str(e),
                            "traceback": "An exception has occurred, use %%tb to see the full traceback.\n\n"
                                         "SystemExit: %s\n" % e})
        except UsageError as e:
            print("UsageError: %s" % e, file=sys.stderr)
        except BaseException as e:  # the user's error (KeyboardInterrupt too): an error line
            tb = sys.exc_info()[2]
            tb = tb.tb_next if tb is not None else None  # our own frame
            self.send_error(type(e), e, tb)
        finally:
            self.flush_figures()

    def set_result(self, value, count):
        self.ns["___"], self.ns["__"], self.ns["_"] = self.ns["__"], self.ns["_"], value
        self.ns["_%d" % count] = value
        self.ns["Out"][count] = value
        self.send_line(result_line(format_bundle(value), True))

    def serve(self):
        signal.signal(signal.SIGINT, self._defer_sigint)
        self.sock.sendall(encode_frame({"warm": True}))
        while True:
            self.interrupt_pending = False
            frame = recv_frame(self.sock)
            if frame is None:
                flush_stdio()
                os._exit(0)
            header, payload = frame
            if "set_env" in header:
                os.environ.clear()
                os.environ.update(dict((str(k), str(v)) for k, v in (header["set_env"] or {}).items()))
                continue
            code = payload.decode("utf-8", "replace")
            env_vars = dict((str(k), str(v)) for k, v in (header.get("env_vars") or {}).items())
            saved = dict((k, os.environ.get(k)) for k in env_vars)
            try:
                try:
                    os.environ.update(env_vars)
                except ValueError as e:
                    self.send_line({"type": "error", "name": "ValueError", "value": "invalid env_vars: %s" % e,
                                    "traceback": ""})
                    continue
                count = self.count
                self.send_line({"type": "number_of_executions", "execution_count": count})
                self.count += 1
                refresh_site()
                try:
                    self.running = True
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                    if self.interrupt_pending:
                        self.interrupt_pending = False
                        raise KeyboardInterrupt
                    self.run_cell(code, count)
                finally:
                    signal.signal(signal.SIGINT, self._defer_sigint)
                    self.running = False
            except KeyboardInterrupt:  # outside the user's code
                self.send_line({"type": "error", "name": "KeyboardInterrupt", "value": "",
                                "traceback": "KeyboardInterrupt"})
            finally:
                for key, value in saved.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value
                self.send({"done": True})


def _user_frames(tb):
    """The traceback from the user's cell on: this script's frames and, for a cell with top-level
    await, the event loop's before the cell's, left out (IPython shows none of its own either)."""
    first = tb
    while tb is not None:
        if _CELL_NAME.match(tb.tb_frame.f_code.co_filename):
            return tb
        tb = tb.tb_next
    while first is not None and first.tb_frame.f_code.co_filename == __file__:
        first = first.tb_next
    return first


def _leading_indent(source):
    """IPython's leading_indent: the first line's indentation taken off every line that has it."""
    lines = source.splitlines(True)
    first = next((ln for ln in lines if ln.strip()), "")
    indent = first[:len(first) - len(first.lstrip())]
    if not indent:
        return source
    return "".join(ln[len(indent):] if ln.startswith(indent) else ln for ln in lines)


def _ends_with_semicolon(source):
    """IPython: a cell whose last line ends with ';' shows no result."""
    for line in reversed(source.splitlines()):
        stripped = line.split("#", 1)[0].rstrip() if "#" in line else line.rstrip()
        if stripped:
            return stripped.endswith(";")
    return False


def main():
    global _site_state
    sys.argv[:] = [""]  # as `python -c`: no path of the runtime in it
    _clean_sys_path()
    _note_pth_files()
    _site_state = _site_stamp()
    os.set_inheritable(CTRL_FD, False)  # `!cmd`, pip and user subprocesses do not get the socket
    install_stdio()
    sock = socket.socket(fileno=CTRL_FD)
    Kernel(sock).serve()


if __name__ == "__main__":
    main()
