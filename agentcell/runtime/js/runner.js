'use strict'
// A JavaScript or TypeScript code context: one node process, started by the agent (kernel_node.py).
//
// It speaks the agent's kernel framing on fd 3 (kernel.py): `{"env_vars"}` + the code as payload runs a
// cell, `{"set_env"}` replaces process.env; it answers `{"line": true}` frames whose payload is one E2B
// line, then `{"done": true}`. fds 1 and 2 are pipes the agent reads itself (writes to pipes are
// synchronous on Linux, so console output is in the pipe before the frame that follows it is sent).
// Cells run in this process's own global scope (vm.runInThisContext), transformed by transform.js.
// argv: [node, runner.js, 'javascript' | 'typescript']

const net = require('net')
const path = require('path')
const util = require('util')
const vm = require('vm')
const { createRequire, isBuiltin } = require('module')
const { pathToFileURL } = require('url')
const { wrap } = require('./transform')

const LANGUAGE = process.argv[2] === 'typescript' ? 'typescript' : 'javascript'
const MAX_LINE = 32 << 20 // as kernel.MAX_LINE
const RUNNER_DIR = __dirname

let ts = null
if (LANGUAGE === 'typescript') {
  ts = require('typescript')
  transpile('const warm: number = 1') // the transpiler's first call is slow (~80 ms): paid while starting
}

function transpile(code) {
  const out = ts.transpileModule(code, {
    reportDiagnostics: true,
    compilerOptions: {
      target: ts.ScriptTarget.ES2022, module: ts.ModuleKind.ESNext, verbatimModuleSyntax: true,
      experimentalDecorators: true, jsx: ts.JsxEmit.Preserve, sourceMap: false,
    },
  })
  const errors = (out.diagnostics || []).filter((d) => d.category === ts.DiagnosticCategory.Error)
  if (errors.length) {
    const d = errors[0]
    const where = d.file && d.start !== undefined ? d.file.getLineAndCharacterOfPosition(d.start) : null
    const err = new SyntaxError(ts.flattenDiagnosticMessageText(d.messageText, '\n') +
      (where ? ` (${where.line + 1}:${where.character + 1})` : ''))
    err.stack = `SyntaxError: ${err.message}`
    throw err
  }
  return out.outputText
}

// -- what cells see ----------------------------------------------------------------------------------
const userRequire = () => createRequire(path.join(process.cwd(), '[cell]'))

async function importModule(spec) {
  spec = String(spec)
  let target = spec
  if (!isBuiltin(spec) && !/^[a-zA-Z][a-zA-Z0-9+.-]*:/.test(spec)) {
    if (spec.startsWith('.') || spec.startsWith('/')) target = pathToFileURL(path.resolve(process.cwd(), spec)).href
    else {
      // bare names resolve from the cell's working directory (its node_modules), not from this file's
      try { target = pathToFileURL(userRequire().resolve(spec)).href } catch { target = spec }
    }
  }
  return import(target)
}

const kernel = {
  global: globalThis,
  import: importModule,
  defaultOf: (m) => (m && 'default' in m ? m.default : m),
  declare(names) {
    for (const n of names) if (!(n in globalThis)) globalThis[n] = undefined
  },
}
Object.defineProperty(globalThis, Symbol.for('agentcell.kernel'), { value: kernel, enumerable: false })
Object.defineProperty(globalThis, 'require', {
  configurable: true, enumerable: false, writable: true,
  value: new Proxy(function require(id) { return userRequire()(id) }, {
    get: (target, prop) => (prop === 'resolve' ? (id, o) => userRequire().resolve(id, o) : Reflect.get(target, prop)),
  }),
})

// -- framing (protocol.encode_frame: u32 header length, u32 payload length, JSON header, payload) ---------
const ctrl = new net.Socket({ fd: 3, readable: true, writable: true })

function frame(header, payload = Buffer.alloc(0)) {
  const head = Buffer.from(JSON.stringify(header))
  const prefix = Buffer.alloc(8)
  prefix.writeUInt32BE(head.length, 0)
  prefix.writeUInt32BE(payload.length, 4)
  return Buffer.concat([prefix, head, payload])
}

function sendLine(line) {
  let data = Buffer.from(JSON.stringify(line))
  if (data.length > MAX_LINE) {
    data = Buffer.from(JSON.stringify({
      type: 'error', name: 'OutputTooLarge',
      value: `a ${line.type || 'output'} of ${data.length} bytes is over the ${MAX_LINE >> 20} MiB limit of one output; ` +
        'write it to a file and read it with files.read',
      traceback: '',
    }))
  }
  ctrl.write(frame(line.type === 'number_of_executions' ? { line: true, hold: true } : { line: true }, data))
}

let pending = Buffer.alloc(0)
const queue = []
let busy = false

ctrl.on('data', (chunk) => {
  pending = pending.length ? Buffer.concat([pending, chunk]) : chunk
  while (pending.length >= 8) {
    const headLen = pending.readUInt32BE(0)
    const payloadLen = pending.readUInt32BE(4)
    if (pending.length < 8 + headLen + payloadLen) break
    const header = JSON.parse(pending.subarray(8, 8 + headLen).toString())
    const payload = pending.subarray(8 + headLen, 8 + headLen + payloadLen).toString()
    pending = pending.subarray(8 + headLen + payloadLen)
    queue.push([header, payload])
  }
  if (!busy) serve()
})
ctrl.on('end', () => process.exit(0))
ctrl.on('error', () => process.exit(0))

function replaceEnv(env) {
  for (const k of Object.keys(process.env)) delete process.env[k]
  Object.assign(process.env, env)
}

// -- running a cell ------------------------------------------------------------------------------------
let executionCount = 1 // as IPython's: the number of the next run
let interruptRun = null // rejects the running cell's wait (SIGINT while it awaits)

process.on('SIGINT', () => { if (interruptRun) interruptRun() }) // between runs: nothing to stop
process.on('uncaughtException', (err) => { process.stderr.write(`Uncaught ${describe(err).traceback}\n`) })
process.on('unhandledRejection', (err) => { process.stderr.write(`Unhandled rejection: ${describe(err).traceback}\n`) })

class Interrupted extends Error {}

function cleanStack(stack) {
  // the cell's own frames only: not this runner's, not node's internals
  return stack.split('\n').filter((l) => !l.includes(RUNNER_DIR) && !/\(node:|at node:/.test(l)).join('\n')
}

function describe(err) {
  if (err instanceof Interrupted || (err && err.code === 'ERR_SCRIPT_EXECUTION_INTERRUPTED')) {
    return { name: 'KeyboardInterrupt', value: 'Script execution interrupted', traceback: 'KeyboardInterrupt' }
  }
  if (err instanceof Error || (err && typeof err === 'object' && typeof err.stack === 'string')) {
    const name = err.name || (err.constructor && err.constructor.name) || 'Error'
    return { name, value: String(err.message ?? ''), traceback: cleanStack(String(err.stack || `${name}: ${err.message}`)) }
  }
  const text = util.inspect(err)
  return { name: 'Error', value: text, traceback: `Uncaught ${text}` }
}

function plainText(value) {
  const text = util.inspect(value, { colors: false, depth: 4, maxStringLength: MAX_LINE })
  // as E2B's code interpreter: a string's representation without its quotes
  if (typeof value === 'string' && text.length >= 2 && text[0] === text[text.length - 1] && `'"\``.includes(text[0])) {
    return text.slice(1, -1)
  }
  return text
}

async function runCell(code, count) {
  const source = LANGUAGE === 'typescript' ? transpile(code) : code
  let script
  try {
    script = new vm.Script(wrap(source), { filename: `<cell ${count}>` })
  } catch (err) {
    if (err instanceof SyntaxError || (err && err.name === 'SyntaxError')) {
      // acorn's message names the line and column of the user's code
      err.stack = `SyntaxError: ${err.message}`
    }
    throw err
  }
  // The synchronous part of the cell can be stopped by SIGINT here (V8 terminates it); once it awaits,
  // the SIGINT handler above rejects the wait. A busy loop after an await cannot be stopped: the agent
  // kills the context when it does not stop within its grace time.
  const promise = script.runInThisContext({ breakOnSigint: true, displayErrors: false })
  return await new Promise((resolve, reject) => {
    interruptRun = () => reject(new Interrupted())
    promise.then(resolve, reject)
  })
}

async function serve() {
  busy = true
  try {
    while (queue.length) {
      const [header, code] = queue.shift()
      if (header.set_env) { replaceEnv(header.set_env); continue }
      const envVars = header.env_vars || {}
      const saved = {}
      for (const k of Object.keys(envVars)) saved[k] = process.env[k]
      try {
        Object.assign(process.env, envVars)
        ctrl.cork() // the run's frames go out together with its end: one write, one wake-up of the agent
        const count = executionCount++
        sendLine({ type: 'number_of_executions', execution_count: count })
        const value = await runCell(code, count)
        if (value !== undefined) {
          sendLine({ type: 'result', text: plainText(value), extra: {}, is_main_result: true })
        }
      } catch (err) {
        sendLine({ type: 'error', ...describe(err) })
      } finally {
        interruptRun = null
        for (const [k, v] of Object.entries(saved)) {
          if (v === undefined) delete process.env[k]
          else process.env[k] = v
        }
        ctrl.write(frame({ done: true }))
        ctrl.uncork()
      }
    }
  } finally {
    busy = false
  }
}

ctrl.write(frame({ warm: true }))
