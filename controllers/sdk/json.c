/* Minimal JSON reader (validating skipper over spans) and writer helpers. */
#include "aici.h"

static uint32_t skip_ws(const char *p, uint32_t i, uint32_t n) {
    while (i < n && (p[i] == ' ' || p[i] == '\t' || p[i] == '\n' || p[i] == '\r')) i++;
    return i;
}

static int hex4(const char *p, uint32_t *out) {
    uint32_t v = 0;
    for (int k = 0; k < 4; k++) {
        char c = p[k];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (uint32_t)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (uint32_t)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (uint32_t)(c - 'A' + 10);
        else return 0;
    }
    *out = v;
    return 1;
}

/* Skips one value starting at i (no leading whitespace); returns the index after it, or 0 on error. */
static uint32_t skip_value(const char *p, uint32_t i, uint32_t n, int depth) {
    if (i >= n || depth > 64) return 0;
    char c = p[i];
    if (c == '"') {
        for (i++; i < n; i++) {
            uint8_t ch = (uint8_t)p[i];
            if (ch == '"') return i + 1;
            if (ch < 0x20) return 0;
            if (ch == '\\') {
                if (++i >= n) return 0;
                char e = p[i];
                uint32_t u;
                if (e == 'u') {
                    if (i + 4 >= n || !hex4(p + i + 1, &u)) return 0;
                    i += 4;
                } else if (!(e == '"' || e == '\\' || e == '/' || e == 'b' || e == 'f' || e == 'n' || e == 'r' ||
                             e == 't')) {
                    return 0;
                }
            }
        }
        return 0;
    }
    if (c == '{' || c == '[') {
        char close = c == '{' ? '}' : ']';
        i = skip_ws(p, i + 1, n);
        if (i < n && p[i] == close) return i + 1;
        for (;;) {
            if (c == '{') {
                if (i >= n || p[i] != '"') return 0;
                if (!(i = skip_value(p, i, n, depth + 1))) return 0;
                i = skip_ws(p, i, n);
                if (i >= n || p[i] != ':') return 0;
                i = skip_ws(p, i + 1, n);
            }
            if (!(i = skip_value(p, i, n, depth + 1))) return 0;
            i = skip_ws(p, i, n);
            if (i >= n) return 0;
            if (p[i] == close) return i + 1;
            if (p[i] != ',') return 0;
            i = skip_ws(p, i + 1, n);
        }
    }
    if (c == 't' || c == 'f' || c == 'n') {
        const char *w = c == 't' ? "true" : c == 'f' ? "false" : "null";
        uint32_t l = (uint32_t)strlen(w);
        return i + l <= n && memcmp(p + i, w, l) == 0 ? i + l : 0;
    }
    /* number: -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)? */
    uint32_t s = i;
    if (p[i] == '-') i++;
    if (i >= n) return 0;
    if (p[i] == '0') i++;
    else if (p[i] >= '1' && p[i] <= '9') while (i < n && p[i] >= '0' && p[i] <= '9') i++;
    else return 0;
    if (i < n && p[i] == '.') {
        uint32_t d = ++i;
        while (i < n && p[i] >= '0' && p[i] <= '9') i++;
        if (i == d) return 0;
    }
    if (i < n && (p[i] == 'e' || p[i] == 'E')) {
        i++;
        if (i < n && (p[i] == '+' || p[i] == '-')) i++;
        uint32_t d = i;
        while (i < n && p[i] >= '0' && p[i] <= '9') i++;
        if (i == d) return 0;
    }
    return i > s ? i : 0;
}

int aici_json_parse(const char *src, uint32_t n, aici_json *out) {
    uint32_t i = skip_ws(src, 0, n);
    uint32_t e = skip_value(src, i, n, 0);
    if (!e || skip_ws(src, e, n) != n) return 0;
    out->p = src + i;
    out->n = e - i;
    return 1;
}

int aici_json_type(aici_json v) {
    if (!v.n) return AICI_J_INVALID;
    switch (v.p[0]) {
    case '{': return AICI_J_OBJECT;
    case '[': return AICI_J_ARRAY;
    case '"': return AICI_J_STRING;
    case 't': return AICI_J_TRUE;
    case 'f': return AICI_J_FALSE;
    case 'n': return AICI_J_NULL;
    default: return AICI_J_NUMBER;
    }
}

/* Values handed out are sub-spans of an already validated document, so iteration can trust the syntax. */
int aici_json_next(aici_json c, aici_json_iter *it, aici_json *key, aici_json *val) {
    int obj = aici_json_type(c) == AICI_J_OBJECT;
    if (!obj && aici_json_type(c) != AICI_J_ARRAY) return 0;
    uint32_t i = skip_ws(c.p, it->pos ? it->pos : 1, c.n);
    if (i >= c.n || c.p[i] == '}' || c.p[i] == ']') return 0;
    if (c.p[i] == ',') i = skip_ws(c.p, i + 1, c.n);
    if (obj) {
        uint32_t e = skip_value(c.p, i, c.n, 0);
        if (key) { key->p = c.p + i; key->n = e - i; }
        i = skip_ws(c.p, e, c.n);
        i = skip_ws(c.p, i + 1, c.n);   /* ':' */
    } else if (key) {
        key->p = NULL;
        key->n = 0;
    }
    uint32_t e = skip_value(c.p, i, c.n, 0);
    if (!e) return 0;
    val->p = c.p + i;
    val->n = e - i;
    it->pos = e;
    return 1;
}

uint32_t aici_json_len(aici_json c) {
    aici_json_iter it = {0};
    aici_json k, v;
    uint32_t n = 0;
    while (aici_json_next(c, &it, &k, &v)) n++;
    return n;
}

int aici_json_get(aici_json obj, const char *key, aici_json *out) {
    if (aici_json_type(obj) != AICI_J_OBJECT) return 0;
    aici_json_iter it = {0};
    aici_json k, v;
    while (aici_json_next(obj, &it, &k, &v)) {
        if (aici_json_str_eq(k, key)) {
            *out = v;
            return 1;
        }
    }
    return 0;
}

int aici_json_int(aici_json v, int64_t *out) {
    if (aici_json_type(v) != AICI_J_NUMBER) return 0;
    uint32_t i = 0;
    int neg = v.p[0] == '-';
    if (neg) i++;
    uint64_t acc = 0;
    for (; i < v.n; i++) {
        char c = v.p[i];
        if (c < '0' || c > '9') return 0;
        if (acc > (0x7FFFFFFFFFFFFFFFull - (uint64_t)(c - '0')) / 10) return 0;
        acc = acc * 10 + (uint64_t)(c - '0');
    }
    *out = neg ? -(int64_t)acc : (int64_t)acc;
    return 1;
}

int aici_json_f64(aici_json v, double *out) {
    if (aici_json_type(v) != AICI_J_NUMBER) return 0;   /* (validated as a JSON number by aici_json_parse) */
    uint32_t i = 0;
    int neg = v.p[0] == '-';
    if (neg) i++;
    double acc = 0, scale = 1;
    for (; i < v.n && v.p[i] >= '0' && v.p[i] <= '9'; i++) acc = acc * 10 + (v.p[i] - '0');
    if (i < v.n && v.p[i] == '.')
        for (i++; i < v.n && v.p[i] >= '0' && v.p[i] <= '9'; i++) acc += (v.p[i] - '0') * (scale /= 10);
    if (i < v.n && (v.p[i] == 'e' || v.p[i] == 'E')) {
        int eneg = 0, e = 0;
        if (++i < v.n && (v.p[i] == '+' || v.p[i] == '-')) eneg = v.p[i++] == '-';
        for (; i < v.n && v.p[i] >= '0' && v.p[i] <= '9'; i++) e = e < 400 ? e * 10 + (v.p[i] - '0') : e;
        for (; e > 0; e--) acc = eneg ? acc / 10 : acc * 10;
    }
    if (i != v.n) return 0;
    *out = neg ? -acc : acc;
    return 1;
}

static void put_utf8(aici_buf *b, uint32_t cp) {
    char t[4];
    if (cp < 0x80) { t[0] = (char)cp; aici_buf_put(b, t, 1); }
    else if (cp < 0x800) { t[0] = (char)(0xC0 | cp >> 6); t[1] = (char)(0x80 | (cp & 63)); aici_buf_put(b, t, 2); }
    else if (cp < 0x10000) {
        t[0] = (char)(0xE0 | cp >> 12); t[1] = (char)(0x80 | (cp >> 6 & 63)); t[2] = (char)(0x80 | (cp & 63));
        aici_buf_put(b, t, 3);
    } else {
        t[0] = (char)(0xF0 | cp >> 18); t[1] = (char)(0x80 | (cp >> 12 & 63));
        t[2] = (char)(0x80 | (cp >> 6 & 63)); t[3] = (char)(0x80 | (cp & 63));
        aici_buf_put(b, t, 4);
    }
}

static void unescape(aici_json v, aici_buf *b) {
    for (uint32_t i = 1; i + 1 < v.n; i++) {
        char c = v.p[i];
        if (c != '\\') { aici_buf_putc(b, c); continue; }
        c = v.p[++i];
        switch (c) {
        case 'b': aici_buf_putc(b, '\b'); break;
        case 'f': aici_buf_putc(b, '\f'); break;
        case 'n': aici_buf_putc(b, '\n'); break;
        case 'r': aici_buf_putc(b, '\r'); break;
        case 't': aici_buf_putc(b, '\t'); break;
        case 'u': {
            uint32_t cp, lo;
            hex4(v.p + i + 1, &cp);
            i += 4;
            if (cp >= 0xD800 && cp < 0xDC00 && i + 6 < v.n && v.p[i + 1] == '\\' && v.p[i + 2] == 'u' &&
                hex4(v.p + i + 3, &lo) && lo >= 0xDC00 && lo < 0xE000) {
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                i += 6;
            } else if (cp >= 0xD800 && cp < 0xE000) {
                cp = 0xFFFD;   /* lone surrogate */
            }
            put_utf8(b, cp);
            break;
        }
        default: aici_buf_putc(b, c);
        }
    }
}

char *aici_json_str(aici_json v, uint32_t *len) {
    if (aici_json_type(v) != AICI_J_STRING) return NULL;
    aici_buf b = {0};
    aici_buf_put(&b, "", 0);
    unescape(v, &b);
    if (len) *len = b.n;
    return b.p;
}

int aici_json_str_eq(aici_json v, const char *s) {
    if (aici_json_type(v) != AICI_J_STRING) return 0;
    uint32_t l = (uint32_t)strlen(s);
    int escaped = 0;
    for (uint32_t i = 1; i + 1 < v.n && !escaped; i++) escaped = v.p[i] == '\\';
    if (!escaped) return v.n == l + 2 && memcmp(v.p + 1, s, l) == 0;
    uint32_t n;
    char *u = aici_json_str(v, &n);
    int eq = n == l && memcmp(u, s, l) == 0;
    free(u);
    return eq;
}

uint32_t *aici_json_u32s(aici_json v, uint32_t *n) {
    *n = 0;
    if (aici_json_type(v) != AICI_J_ARRAY) return NULL;
    uint32_t cnt = aici_json_len(v), i = 0;
    uint32_t *out = malloc(cnt * 4 + 4);
    aici_json_iter it = {0};
    aici_json e;
    int64_t x;
    while (aici_json_next(v, &it, NULL, &e)) {
        if (!aici_json_int(e, &x) || x < 0 || x > 0xFFFFFFFFll) { free(out); return NULL; }
        out[i++] = (uint32_t)x;
    }
    *n = i;
    return out;
}

void aici_json_put_str(aici_buf *b, const char *s, uint32_t n) {
    static const char hex[] = "0123456789abcdef";
    aici_buf_putc(b, '"');
    for (uint32_t i = 0; i < n; i++) {
        uint8_t c = (uint8_t)s[i];
        if (c == '"' || c == '\\') { aici_buf_putc(b, '\\'); aici_buf_putc(b, (char)c); }
        else if (c == '\n') aici_buf_puts(b, "\\n");
        else if (c == '\t') aici_buf_puts(b, "\\t");
        else if (c == '\r') aici_buf_puts(b, "\\r");
        else if (c < 0x20) {
            char e[6] = {'\\', 'u', '0', '0', hex[c >> 4], hex[c & 15]};
            aici_buf_put(b, e, 6);
        } else aici_buf_putc(b, (char)c);
    }
    aici_buf_putc(b, '"');
}

void aici_json_put_u32s(aici_buf *b, const uint32_t *v, uint32_t n) {
    aici_buf_putc(b, '[');
    for (uint32_t i = 0; i < n; i++) {
        if (i) aici_buf_putc(b, ',');
        aici_buf_u64(b, v[i]);
    }
    aici_buf_putc(b, ']');
}
