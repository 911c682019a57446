// Small hooks the pages share.
import { useEffect, useRef, useState } from "preact/hooks";

// load() now and every `ms` (0: once); {data, error, reload}
export function usePoll(load, ms, deps = []) {
  const [state, setState] = useState({ data: null, error: null });
  const alive = useRef(true);
  const tick = useRef(0);
  const run = async () => {
    const mine = ++tick.current;
    try {
      const data = await load();
      if (alive.current && mine === tick.current) setState({ data, error: null });
    } catch (error) {
      if (alive.current && mine === tick.current) setState((s) => ({ data: s.data, error }));
    }
  };
  useEffect(() => {
    alive.current = true;
    setState({ data: null, error: null });
    run();
    const timer = ms ? setInterval(run, ms) : null;
    return () => {
      alive.current = false;
      if (timer) clearInterval(timer);
    };
  }, deps);
  return { ...state, reload: run };
}
