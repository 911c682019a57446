'use strict'
// A cell of JavaScript -> a script whose top-level declarations outlive the cell.
//
// A cell runs as the body of an async function (top-level await works), so its own declarations would
// die with it. acorn parses the cell; the top-level `var`/`let`/`const`, `class`, `function` and
// `import` declarations become assignments to globals, `import(...)` goes through the context's
// loader (a vm script has no module loader of its own), and the last expression statement is
// returned: that value is the cell's result. Edits are made on the source text, so everything else
// (and every line number) stays as the user wrote it.

const acorn = require('acorn')
const walk = require('acorn-walk')

const K = '__agentcell__' // the wrapper's one parameter: the runner's helpers (runner.js)

function patternNames(node, out) {
  switch (node.type) {
    case 'Identifier': out.push(node.name); break
    case 'ObjectPattern': for (const p of node.properties) patternNames(p.type === 'RestElement' ? p.argument : p.value, out); break
    case 'ArrayPattern': for (const e of node.elements) if (e) patternNames(e, out); break
    case 'RestElement': patternNames(node.argument, out); break
    case 'AssignmentPattern': patternNames(node.left, out); break
  }
  return out
}

class Edits {
  constructor(src) { this.src = src; this.list = [] }
  replace(start, end, text) { this.list.push({ start, end, text, seq: this.list.length }) }
  insert(pos, text) { this.replace(pos, pos, text) }
  apply() {
    // Back to front; at one position a replaced range goes first, then insertions (later-added ends up
    // outermost: `return (` is added before an inner edit's insertions at the same start).
    const sorted = [...this.list].sort((a, b) => b.start - a.start || (b.end - b.start) - (a.end - a.start) || a.seq - b.seq)
    let out = this.src
    for (const e of sorted) out = out.slice(0, e.start) + e.text + out.slice(e.end)
    return out
  }
}

function importCode(node, src) {
  const spec = JSON.stringify(node.source.value)
  const parts = [`const __m = await ${K}.import(${spec});`]
  for (const s of node.specifiers) {
    if (s.type === 'ImportDefaultSpecifier') parts.push(`${s.local.name} = ${K}.defaultOf(__m);`)
    else if (s.type === 'ImportNamespaceSpecifier') parts.push(`${s.local.name} = __m;`)
    else {
      const name = s.imported.type === 'Identifier' ? s.imported.name : s.imported.value
      parts.push(`${s.local.name} = __m[${JSON.stringify(name)}];`)
    }
  }
  return `{ ${parts.join(' ')} }`
}

// -> { code, names, functions }: the script body, the names it declares, the functions to publish.
function transform(src) {
  const ast = acorn.parse(src, {
    ecmaVersion: 'latest', sourceType: 'script', allowAwaitOutsideFunction: true,
    allowImportExportEverywhere: true, allowHashBang: true, allowReturnOutsideFunction: false,
  })
  const ed = new Edits(src)
  const names = []
  const functions = []
  walk.full(ast, (node) => {
    if (node.type === 'ImportExpression') ed.replace(node.start, node.start + 'import'.length, `${K}.import`)
  })
  const declare = (decl) => {
    if (decl.type === 'VariableDeclaration') {
      const last = decl.declarations[decl.declarations.length - 1]
      ed.replace(decl.start, decl.declarations[0].start, ';(') // `const a = 1, {b} = o` -> `;(a = 1, {b} = o)`
      for (const d of decl.declarations) {
        patternNames(d.id, names)
        if (!d.init && decl.kind !== 'var') ed.insert(d.id.end, ' = undefined')
      }
      ed.replace(last.end, decl.end, ');')
    } else if (decl.type === 'FunctionDeclaration') {
      names.push(decl.id.name)
      functions.push(decl.id.name) // hoisted in the wrapper; published to the global at its start
    } else if (decl.type === 'ClassDeclaration') {
      names.push(decl.id.name)
      ed.insert(decl.start, `${decl.id.name} = `)
      ed.insert(decl.end, ';')
    }
  }
  let body = ast.body
  // The result is the last statement that does something (TypeScript's output may end in `export {};`).
  let lastIdx = body.length - 1
  while (lastIdx >= 0 && (body[lastIdx].type === 'EmptyStatement' ||
         (body[lastIdx].type === 'ExportNamedDeclaration' && !body[lastIdx].declaration && !body[lastIdx].source &&
          body[lastIdx].specifiers.length === 0))) lastIdx--
  body.forEach((stmt, i) => {
    switch (stmt.type) {
      case 'VariableDeclaration':
      case 'FunctionDeclaration':
      case 'ClassDeclaration':
        declare(stmt)
        break
      case 'ImportDeclaration':
        for (const s of stmt.specifiers) names.push(s.local.name)
        ed.replace(stmt.start, stmt.end, importCode(stmt, src))
        break
      case 'ExportNamedDeclaration':
        if (stmt.declaration) {
          ed.replace(stmt.start, stmt.declaration.start, '')
          declare(stmt.declaration)
        } else ed.replace(stmt.start, stmt.end, ';') // `export { a }`: the names are globals already
        break
      case 'ExportAllDeclaration':
        ed.replace(stmt.start, stmt.end, ';')
        break
      case 'ExportDefaultDeclaration': {
        const d = stmt.declaration
        if ((d.type === 'FunctionDeclaration' || d.type === 'ClassDeclaration') && d.id) {
          ed.replace(stmt.start, d.start, '')
          declare(d)
        } else {
          ed.replace(stmt.start, d.start, i === lastIdx ? 'return (' : ';(')
          ed.insert(stmt.end, ');')
        }
        break
      }
      case 'ExpressionStatement':
        if (i === lastIdx && !stmt.directive) {
          // around the whole statement but its `;`: the expression may sit in parentheses of its own
          const end = src[stmt.end - 1] === ';' ? stmt.end - 1 : stmt.end
          ed.insert(stmt.start, 'return (')
          ed.insert(end, ')')
        }
        break
    }
  })
  return { code: ed.apply(), names: [...new Set(names)], functions }
}

// The script that runs a cell: everything on the cell's first line, so line numbers stay the user's.
function wrap(src) {
  const { code, names, functions } = transform(src)
  const publish = functions.map((f) => `${K}.global[${JSON.stringify(f)}] = ${f};`).join(' ')
  return `(async function (${K}) { ${K}.declare(${JSON.stringify(names)}); ${publish} ${code}\n})` +
    `.call(globalThis, globalThis[Symbol.for('agentcell.kernel')])`
}

module.exports = { transform, wrap }
