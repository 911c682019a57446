// The frame around every page: who is signed in, the navigation, and the page the hash names.
import { useEffect, useState } from "preact/hooks";
import { getJSON, request, session, setSession } from "./api.js";
import { HealthPage } from "./pages/health.jsx";
import { ReportPage } from "./pages/report.jsx";
import { SandboxPage } from "./pages/sandbox.jsx";
import { SandboxesPage } from "./pages/sandboxes.jsx";
import { SignInPage } from "./pages/signin.jsx";
import { SnapshotsPage } from "./pages/snapshots.jsx";
import { TemplatesPage } from "./pages/templates.jsx";
import { go, href, useRoute } from "./router.js";

function useSession() {
  const [current, setCurrent] = useState(session.current);
  const [checked, setChecked] = useState(false);
  const [keyRequired, setKeyRequired] = useState(true);
  useEffect(() => {
    session.listeners.add(setCurrent);
    getJSON("/session")
      .then((s) => setSession(s))
      .catch((e) => {
        if (e.body && typeof e.body.keyRequired === "boolean") setKeyRequired(e.body.keyRequired);
        setSession(null);
      })
      .finally(() => setChecked(true));
    return () => session.listeners.delete(setCurrent);
  }, []);
  return { current, checked, keyRequired, setKeyRequired };
}

const NAV = [
  ["sandboxes", "Sandboxes"],
  ["snapshots", "Snapshots"],
  ["templates", "Templates"],
  ["health", "Health"],
];

function Header({ route, current }) {
  const signOut = async () => {
    try {
      await request("/session", { method: "DELETE" });
    } finally {
      setSession(null);
      go("signin");
    }
  };
  const active = route.page === "sandbox" || route.page === "report" ? "sandboxes" : route.page;
  return (
    <header class="top">
      <a class="brand" href={href("sandboxes")}>agentcell</a>
      <nav aria-label="Main">
        {NAV.map(([page, label]) => (
          <a href={href(page)} aria-current={active === page ? "page" : undefined}>{label}</a>
        ))}
      </nav>
      <div class="who">
        <span class={`role role-${current.role}`} title="your role in this console">{current.role}</span>
        {current.server?.kind === "gateway" && <span class="badge">gateway</span>}
        <button type="button" class="quiet" onClick={signOut}>Sign out</button>
      </div>
    </header>
  );
}

export function App() {
  const route = useRoute();
  const { current, checked, keyRequired, setKeyRequired } = useSession();
  if (!checked) return <main class="page"><p class="muted">Loading…</p></main>;
  if (!current || route.page === "signin") {
    return <SignInPage keyRequired={keyRequired} onKeyRequired={setKeyRequired} signedIn={current} />;
  }
  let page;
  if (route.page === "sandbox") page = <SandboxPage id={route.id} key={route.id} />;
  else if (route.page === "report") page = <ReportPage id={route.id} key={route.id} />;
  else if (route.page === "snapshots") page = <SnapshotsPage />;
  else if (route.page === "templates") page = <TemplatesPage />;
  else if (route.page === "health") page = <HealthPage />;
  else page = <SandboxesPage />;
  return (
    <>
      <Header route={route} current={current} />
      <main class="page">{page}</main>
    </>
  );
}
