// The console's entry point: the stylesheets (bundled into one file) and the app in #app.
import "@xterm/xterm/css/xterm.css";
import "uplot/dist/uPlot.min.css";
import "./style.css";
import { render } from "preact";
import { App } from "./app.jsx";

render(<App />, document.getElementById("app"));
