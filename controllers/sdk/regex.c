/* Byte-level regex: recursive-descent parser -> Thompson NFA -> lazily built DFA (states interned by their
 * NFA-state sets, transitions cached per state). DFA state 0 is the dead state. */
#include "aici.h"

enum { N_EPS, N_SPLIT, N_SET, N_MATCH };
#define MAX_NFA 20000
#define MAX_DFA 8192
#define MAX_DEPTH 100

typedef struct { uint8_t type; uint32_t out, out2, set; } nfa_node;
typedef struct { uint32_t bits[8]; } byteset;
typedef struct { uint32_t start, end; } frag;   /* end: an N_EPS node whose out is patched later */
typedef struct { uint32_t off, n; uint8_t accepting, finished; uint32_t *trans; } dfa_state;

struct aici_regex {
    aici_functional fn;
    nfa_node *nfa;
    uint32_t n_nfa, cap_nfa;
    byteset *sets;
    uint32_t n_sets, cap_sets;
    uint32_t start;
    /* DFA */
    dfa_state *dfa;
    uint32_t n_dfa, cap_dfa;
    uint32_t *pool;   /* concatenated NFA-state sets */
    uint32_t n_pool, cap_pool;
    uint32_t *htab;   /* open addressing, value = dfa id + 1 */
    uint32_t hcap;
    uint32_t *mark, *work;   /* scratch: bitmap over NFA nodes, DFS stack */
    uint32_t initial;
    /* parser */
    const char *src;
    uint32_t len, pos, depth;
    const char *err;
};

#define GROW(arr, n, cap, init)                                      \
    do {                                                             \
        if ((n) >= (cap)) {                                          \
            (cap) = (cap) ? (cap) * 2 : (init);                      \
            (arr) = realloc((arr), (cap) * sizeof(*(arr)));          \
        }                                                            \
    } while (0)

static uint32_t node(aici_regex *rx, uint8_t type, uint32_t out, uint32_t out2, uint32_t set) {
    if (rx->n_nfa >= MAX_NFA) {
        rx->err = "regex too large";
        return 0;
    }
    GROW(rx->nfa, rx->n_nfa, rx->cap_nfa, 64);
    rx->nfa[rx->n_nfa] = (nfa_node){type, out, out2, set};
    return rx->n_nfa++;
}

static frag frag_set(aici_regex *rx, const byteset *s) {
    GROW(rx->sets, rx->n_sets, rx->cap_sets, 16);
    rx->sets[rx->n_sets] = *s;
    uint32_t e = node(rx, N_EPS, 0, 0, 0);
    uint32_t n = node(rx, N_SET, e, 0, rx->n_sets++);
    return (frag){n, e};
}
static frag frag_empty(aici_regex *rx) {
    uint32_t e = node(rx, N_EPS, 0, 0, 0);
    return (frag){e, e};
}
static void patch(aici_regex *rx, frag a, uint32_t to) { rx->nfa[a.end].out = to; }
static frag concat(aici_regex *rx, frag a, frag b) {
    patch(rx, a, b.start);
    return (frag){a.start, b.end};
}
static frag alt(aici_regex *rx, frag a, frag b) {
    uint32_t e = node(rx, N_EPS, 0, 0, 0);
    patch(rx, a, e);
    patch(rx, b, e);
    return (frag){node(rx, N_SPLIT, a.start, b.start, 0), e};
}
static frag star(aici_regex *rx, frag a) {
    uint32_t e = node(rx, N_EPS, 0, 0, 0);
    uint32_t s = node(rx, N_SPLIT, a.start, e, 0);
    patch(rx, a, s);
    return (frag){s, e};
}
static frag plus(aici_regex *rx, frag a) {
    uint32_t e = node(rx, N_EPS, 0, 0, 0);
    uint32_t s = node(rx, N_SPLIT, a.start, e, 0);
    patch(rx, a, s);
    return (frag){a.start, e};
}
static frag opt(aici_regex *rx, frag a) {
    uint32_t e = node(rx, N_EPS, 0, 0, 0);
    patch(rx, a, e);
    return (frag){node(rx, N_SPLIT, a.start, e, 0), e};
}

static void set_add(byteset *s, uint32_t b) { s->bits[b >> 5] |= 1u << (b & 31); }
static void set_range(byteset *s, uint32_t lo, uint32_t hi) {
    for (uint32_t b = lo; b <= hi; b++) set_add(s, b);
}
static void set_invert(byteset *s) {
    for (int i = 0; i < 8; i++) s->bits[i] = ~s->bits[i];
}
static void set_union(byteset *s, const byteset *t) {
    for (int i = 0; i < 8; i++) s->bits[i] |= t->bits[i];
}

static int peek(aici_regex *rx) { return rx->pos < rx->len ? (uint8_t)rx->src[rx->pos] : -1; }

static int hexdig(int c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Parses the escape after '\' into a byte set. */
static int parse_escape(aici_regex *rx, byteset *s) {
    int c = peek(rx);
    if (c < 0) { rx->err = "trailing backslash"; return 0; }
    rx->pos++;
    byteset t = {{0}};
    int neg = 0;
    switch (c) {
    case 'n': set_add(s, '\n'); return 1;
    case 't': set_add(s, '\t'); return 1;
    case 'r': set_add(s, '\r'); return 1;
    case 'f': set_add(s, '\f'); return 1;
    case 'v': set_add(s, '\v'); return 1;
    case '0': set_add(s, 0); return 1;
    case 'x': {
        int h = rx->pos + 1 < rx->len ? hexdig((uint8_t)rx->src[rx->pos]) : -1;
        int l = h >= 0 ? hexdig((uint8_t)rx->src[rx->pos + 1]) : -1;
        if (l < 0) { rx->err = "bad \\x escape"; return 0; }
        rx->pos += 2;
        set_add(s, (uint32_t)(h * 16 + l));
        return 1;
    }
    case 'D': neg = 1; /* fallthrough */
    case 'd': set_range(&t, '0', '9'); break;
    case 'W': neg = 1; /* fallthrough */
    case 'w': set_range(&t, '0', '9'); set_range(&t, 'a', 'z'); set_range(&t, 'A', 'Z'); set_add(&t, '_'); break;
    case 'S': neg = 1; /* fallthrough */
    case 's': set_add(&t, ' '); set_range(&t, '\t', '\r'); break;
    default:
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) {
            rx->err = "unsupported escape";
            return 0;
        }
        set_add(s, (uint32_t)c);
        return 1;
    }
    if (neg) set_invert(&t);
    set_union(s, &t);
    return 1;
}

static int parse_class(aici_regex *rx, byteset *s) {
    int neg = 0;
    if (peek(rx) == '^') { neg = 1; rx->pos++; }
    int first = 1;
    for (;;) {
        int c = peek(rx);
        if (c < 0) { rx->err = "unterminated class"; return 0; }
        if (c == ']' && !first) { rx->pos++; break; }
        first = 0;
        rx->pos++;
        byteset one = {{0}};
        int lo = -1;
        if (c == '\\') {
            if (!parse_escape(rx, &one)) return 0;
            int cnt = 0;
            for (int b = 0; b < 256; b++)
                if (one.bits[b >> 5] >> (b & 31) & 1) { cnt++; lo = b; }
            if (cnt != 1) lo = -1;
        } else {
            lo = c;
            set_add(&one, (uint32_t)c);
        }
        if (lo >= 0 && peek(rx) == '-' && rx->pos + 1 < rx->len && rx->src[rx->pos + 1] != ']') {
            rx->pos++;
            int hi = peek(rx);
            rx->pos++;
            if (hi == '\\') {
                byteset h = {{0}};
                if (!parse_escape(rx, &h)) return 0;
                hi = -1;
                for (int b = 0; b < 256; b++)
                    if (h.bits[b >> 5] >> (b & 31) & 1) { hi = b; break; }
            }
            if (hi < lo) { rx->err = "bad class range"; return 0; }
            set_range(&one, (uint32_t)lo, (uint32_t)hi);
        }
        set_union(s, &one);
    }
    if (neg) set_invert(s);
    return 1;
}

static frag parse_alt(aici_regex *rx);

static frag parse_atom(aici_regex *rx) {
    int c = peek(rx);
    byteset s = {{0}};
    rx->pos++;
    if (c == '(') {
        if (rx->pos + 1 < rx->len && rx->src[rx->pos] == '?' && rx->src[rx->pos + 1] == ':') rx->pos += 2;
        if (++rx->depth > MAX_DEPTH) { rx->err = "regex nested too deeply"; return frag_empty(rx); }
        frag f = parse_alt(rx);
        rx->depth--;
        if (peek(rx) != ')') { rx->err = "missing )"; return f; }
        rx->pos++;
        return f;
    }
    if (c == '[') {
        if (!parse_class(rx, &s)) return frag_empty(rx);
        return frag_set(rx, &s);
    }
    if (c == '.') {
        set_invert(&s);
        s.bits['\n' >> 5] &= ~(1u << ('\n' & 31));
        return frag_set(rx, &s);
    }
    if (c == '\\') {
        if (!parse_escape(rx, &s)) return frag_empty(rx);
        return frag_set(rx, &s);
    }
    if (c == '*' || c == '+' || c == '?') { rx->err = "nothing to repeat"; return frag_empty(rx); }
    set_add(&s, (uint32_t)c);
    return frag_set(rx, &s);
}

/* Reads a decimal count at *p (saturating at 100000); 0 if there is no digit. */
static int read_count(aici_regex *rx, uint32_t *p, int *out) {
    int v = 0, digits = 0;
    for (; *p < rx->len && rx->src[*p] >= '0' && rx->src[*p] <= '9'; (*p)++, digits++)
        if (v < 100000) v = v * 10 + rx->src[*p] - '0';
    *out = v;
    return digits > 0;
}

/* {m}, {m,}, {m,n}, {,n}: returns 1 and the bounds (max = -1 for none), or 0 if this '{' is a literal. */
static int parse_braces(aici_regex *rx, int *mn, int *mx) {
    uint32_t p = rx->pos + 1;
    int a, b;
    int has_min = read_count(rx, &p, &a);
    b = a;
    if (p < rx->len && rx->src[p] == ',') {
        p++;
        if (!read_count(rx, &p, &b)) {
            if (!has_min) return 0;   /* "{,}" */
            b = -1;
        }
    } else if (!has_min) {
        return 0;
    }
    if (!has_min) a = 0;
    if (p >= rx->len || rx->src[p] != '}') return 0;
    rx->pos = p + 1;
    *mn = a;
    *mx = b;
    return 1;
}

static frag parse_repeat(aici_regex *rx) {
    uint32_t atom_pos = rx->pos;
    frag f = parse_atom(rx);
    for (;;) {
        int c = peek(rx), mn, mx;
        if (rx->err) return f;
        if (c == '*') { rx->pos++; f = star(rx, f); }
        else if (c == '+') { rx->pos++; f = plus(rx, f); }
        else if (c == '?') { rx->pos++; f = opt(rx, f); }
        else if (c == '{' && parse_braces(rx, &mn, &mx)) {
            if (mx >= 0 && mx < mn) { rx->err = "bad repetition bounds"; return f; }
            /* copies are re-parsed from the atom's source text */
            uint32_t after = rx->pos;
            int copies = mx < 0 ? (mn > 0 ? mn : 1) : mx;
            frag out = frag_empty(rx);
            for (int i = 0; i < copies && !rx->err; i++) {
                frag one;
                if (i == 0) one = f;
                else { rx->pos = atom_pos; one = parse_atom(rx); }
                if (mx < 0 && i == copies - 1) one = mn > 0 ? plus(rx, one) : star(rx, one);
                else if (i >= mn) one = opt(rx, one);
                out = concat(rx, out, one);
            }
            rx->pos = after;
            f = out;
        } else return f;
    }
}

static frag parse_concat(aici_regex *rx) {
    frag f = frag_empty(rx);
    for (;;) {
        int c = peek(rx);
        if (c < 0 || c == '|' || c == ')' || rx->err) return f;
        f = concat(rx, f, parse_repeat(rx));
    }
}

static frag parse_alt(aici_regex *rx) {
    frag f = parse_concat(rx);
    while (peek(rx) == '|' && !rx->err) {
        rx->pos++;
        f = alt(rx, f, parse_concat(rx));
    }
    return f;
}

/* ---------- lazy DFA ---------- */
static uint32_t hash_set(const uint32_t *s, uint32_t n) {
    uint32_t h = 2166136261u ^ n;
    for (uint32_t i = 0; i < n; i++) h = (h ^ s[i]) * 16777619u;
    return h;
}

static void htab_insert(aici_regex *rx, uint32_t id) {
    uint32_t h = hash_set(rx->pool + rx->dfa[id].off, rx->dfa[id].n) & (rx->hcap - 1);
    while (rx->htab[h]) h = (h + 1) & (rx->hcap - 1);
    rx->htab[h] = id + 1;
}

/* Interns the set in rx->work[0..n) (sorted); returns the DFA id, or 0 (dead) when empty or out of room. */
static uint32_t intern(aici_regex *rx, const uint32_t *set, uint32_t n) {
    if (!n) return 0;
    uint32_t h = hash_set(set, n) & (rx->hcap - 1);
    while (rx->htab[h]) {
        dfa_state *d = &rx->dfa[rx->htab[h] - 1];
        if (d->n == n && memcmp(rx->pool + d->off, set, n * 4) == 0) return rx->htab[h] - 1;
        h = (h + 1) & (rx->hcap - 1);
    }
    if (rx->n_dfa >= MAX_DFA) {
        aici_logs("aici regex: DFA state limit reached\n");
        return 0;
    }
    while (rx->n_pool + n > rx->cap_pool) {
        rx->cap_pool = rx->cap_pool ? rx->cap_pool * 2 : 1024;
        rx->pool = realloc(rx->pool, rx->cap_pool * 4);
    }
    memcpy(rx->pool + rx->n_pool, set, n * 4);
    GROW(rx->dfa, rx->n_dfa, rx->cap_dfa, 64);
    uint32_t id = rx->n_dfa++;
    dfa_state *d = &rx->dfa[id];
    d->off = rx->n_pool;
    d->n = n;
    d->accepting = 0;
    d->finished = 0;
    d->trans = NULL;
    for (uint32_t i = 0; i < n; i++)
        if (rx->nfa[set[i]].type == N_MATCH) d->accepting = 1;
    rx->n_pool += n;
    if (rx->n_dfa * 2 > rx->hcap) {
        free(rx->htab);
        rx->hcap *= 2;
        rx->htab = calloc(rx->hcap, 4);
        for (uint32_t i = 1; i < rx->n_dfa; i++) htab_insert(rx, i);
    } else {
        rx->htab[h] = id + 1;
    }
    return id;
}

static void closure_add(aici_regex *rx, uint32_t s, uint32_t *sp) {
    if (rx->mark[s >> 5] >> (s & 31) & 1) return;
    rx->mark[s >> 5] |= 1u << (s & 31);
    rx->work[(*sp)++] = s;
}

/* Epsilon closure of the states already marked+pushed; keeps only N_SET/N_MATCH, sorted, in rx->work. */
static uint32_t closure_collect(aici_regex *rx, uint32_t sp) {
    while (sp) {
        nfa_node *nd = &rx->nfa[rx->work[--sp]];
        if (nd->type == N_EPS) closure_add(rx, nd->out, &sp);
        else if (nd->type == N_SPLIT) { closure_add(rx, nd->out, &sp); closure_add(rx, nd->out2, &sp); }
    }
    uint32_t n = 0, words = (rx->n_nfa + 31) / 32;
    for (uint32_t w = 0; w < words; w++) {
        uint32_t bits = rx->mark[w];
        rx->mark[w] = 0;
        while (bits) {
            uint32_t s = w * 32 + (uint32_t)__builtin_ctz(bits);
            bits &= bits - 1;
            if (rx->nfa[s].type == N_SET || rx->nfa[s].type == N_MATCH) rx->work[n++] = s;
        }
    }
    return n;
}

int aici_regex_step(aici_regex *rx, uint32_t state, uint8_t b, uint32_t *next) {
    dfa_state *d = &rx->dfa[state];
    if (!state) return 0;
    if (!d->trans) d->trans = calloc(256, 4);
    uint32_t t = d->trans[b];
    if (!t) {
        uint32_t sp = 0;
        for (uint32_t i = 0; i < d->n; i++) {
            nfa_node *nd = &rx->nfa[rx->pool[d->off + i]];
            if (nd->type == N_SET && (rx->sets[nd->set].bits[b >> 5] >> (b & 31) & 1)) closure_add(rx, nd->out, &sp);
        }
        uint32_t n = closure_collect(rx, sp);
        t = intern(rx, rx->work, n) + 1;
        rx->dfa[state].trans[b] = t;   /* rx->dfa may have moved */
    }
    *next = t - 1;
    return t != 1;
}

int aici_regex_accepting(aici_regex *rx, uint32_t state) { return rx->dfa[state].accepting; }

int aici_regex_finished(aici_regex *rx, uint32_t state) {
    if (!state) return 1;
    if (rx->dfa[state].finished) return rx->dfa[state].finished == 2;
    uint32_t nx;
    int any = 0;
    for (uint32_t b = 0; b < 256 && !any; b++) any = aici_regex_step(rx, state, (uint8_t)b, &nx);
    rx->dfa[state].finished = any ? 1 : 2;
    return !any;
}

uint32_t aici_regex_initial(aici_regex *rx) { return rx->initial; }

int aici_regex_matches(aici_regex *rx, const char *s, uint32_t len) {
    uint32_t st = rx->initial;
    for (uint32_t i = 0; i < len; i++)
        if (!aici_regex_step(rx, st, (uint8_t)s[i], &st)) return 0;
    return aici_regex_accepting(rx, st);
}

static uint32_t fn_initial(aici_functional *f) { return ((aici_regex *)f)->initial; }
static int fn_append(aici_functional *f, uint32_t st, uint8_t b, uint32_t *next) {
    return aici_regex_step((aici_regex *)f, st, b, next);
}
static int fn_special(aici_functional *f, uint32_t st, uint32_t tok) {
    return tok == aici_eos() && aici_regex_accepting((aici_regex *)f, st);
}

aici_functional *aici_regex_functional(aici_regex *rx) { return &rx->fn; }

aici_regex *aici_regex_new(const char *pattern, uint32_t len, const char **err) {
    aici_regex *rx = calloc(1, sizeof(aici_regex));
    rx->fn = (aici_functional){fn_initial, fn_append, fn_special};
    rx->src = pattern;
    rx->len = len;
    if (len && pattern[0] == '^') rx->pos = 1;
    if (len > rx->pos && pattern[len - 1] == '$' && (len < 2 || pattern[len - 2] != '\\')) rx->len--;
    frag f = parse_alt(rx);
    if (!rx->err && rx->pos < rx->len) rx->err = "unbalanced )";
    if (!rx->err) {
        patch(rx, f, node(rx, N_MATCH, 0, 0, 0));
        rx->start = f.start;
    }
    if (rx->err) {
        if (err) *err = rx->err;
        free(rx->nfa);
        free(rx->sets);
        free(rx);
        return NULL;
    }
    rx->src = NULL;
    rx->mark = calloc((rx->n_nfa + 31) / 32 + 1, 4);
    rx->work = malloc(rx->n_nfa * 4 + 4);
    rx->hcap = 64;
    rx->htab = calloc(rx->hcap, 4);
    /* DFA state 0 = dead: an empty set, never in the hash table. */
    GROW(rx->dfa, rx->n_dfa, rx->cap_dfa, 64);
    rx->dfa[0] = (dfa_state){0, 0, 0, 2, NULL};
    rx->n_dfa = 1;
    uint32_t sp = 0;
    closure_add(rx, rx->start, &sp);
    rx->initial = intern(rx, rx->work, closure_collect(rx, sp));
    return rx;
}

void aici_regex_escape(aici_buf *b, const char *s, uint32_t len) {
    for (uint32_t i = 0; i < len; i++) {
        uint8_t c = (uint8_t)s[i];
        if (c == '\\' || c == '.' || c == '*' || c == '+' || c == '?' || c == '|' || c == '(' || c == ')' ||
            c == '[' || c == ']' || c == '{' || c == '}' || c == '^' || c == '$') {
            aici_buf_putc(b, '\\');
            aici_buf_putc(b, (char)c);
        } else if (c < 0x20 || c == 0x7F) {
            static const char hex[] = "0123456789abcdef";
            char e[4] = {'\\', 'x', hex[c >> 4], hex[c & 15]};
            aici_buf_put(b, e, 4);
        } else {
            aici_buf_putc(b, (char)c);
        }
    }
}
