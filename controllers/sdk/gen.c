/* Constraint specs in JSON and one generation (constraint + stop strings + token limit), shared by the
 * constrain and declctrl controllers. */
#include "aici.h"

static int32_t from_text(int32_t kind, aici_json v, const char **err) {
    uint32_t n;
    char *s = aici_json_str(v, &n);
    if (!s) {
        *err = "constraint source must be a string";
        return -1;
    }
    int32_t h = aici_constraint_new(kind, s, n);
    free(s);
    if (h <= 0) {
        *err = "the host rejected the constraint (see the runtime logs for the parser's message)";
        return -1;
    }
    return h;
}

int32_t aici_constraint_from_json(aici_json spec, const char **err) {
    aici_json v, syn;
    if (aici_json_get(spec, "regex", &v) || aici_json_get(spec, "rx", &v)) return from_text(AICI_C_REGEX, v, err);
    if (aici_json_get(spec, "json_schema", &v)) {
        if (aici_json_type(v) == AICI_J_STRING) return from_text(AICI_C_JSON_SCHEMA, v, err);
        if (aici_json_type(v) != AICI_J_OBJECT && aici_json_type(v) != AICI_J_TRUE) {
            *err = "json_schema must be an object or a string";
            return -1;
        }
        int32_t h = aici_constraint_new(AICI_C_JSON_SCHEMA, v.p, v.n);
        if (h <= 0) *err = "the host rejected the JSON schema";
        return h > 0 ? h : -1;
    }
    if (aici_json_get(spec, "yacc", &v)) return from_text(AICI_C_YACC, v, err);
    if (aici_json_get(spec, "lark", &v)) return from_text(AICI_C_LARK, v, err);
    if (aici_json_get(spec, "grammar", &v)) {
        int kind = AICI_C_LARK;
        if (aici_json_get(spec, "syntax", &syn)) {
            if (aici_json_str_eq(syn, "yacc")) kind = AICI_C_YACC;
            else if (!aici_json_str_eq(syn, "lark")) {
                *err = "syntax must be \"lark\" or \"yacc\"";
                return -1;
            }
        }
        return from_text(kind, v, err);
    }
    if (aici_json_get(spec, "choices", &v) || aici_json_get(spec, "options", &v)) {
        if (aici_json_type(v) != AICI_J_ARRAY || aici_json_len(v) == 0) {
            *err = "choices must be a non-empty array of strings";
            return -1;
        }
        aici_buf rx = {0};
        aici_json_iter it = {0};
        aici_json e;
        while (aici_json_next(v, &it, NULL, &e)) {
            uint32_t n;
            char *s = aici_json_str(e, &n);
            if (!s) {
                aici_buf_free(&rx);
                *err = "choices must be strings";
                return -1;
            }
            aici_buf_puts(&rx, rx.n ? "|(" : "(");
            aici_regex_escape(&rx, s, n);
            aici_buf_putc(&rx, ')');
            free(s);
        }
        int32_t h = aici_constraint_new(AICI_C_REGEX, rx.p, rx.n);
        aici_buf_free(&rx);
        if (h <= 0) *err = "the host rejected the choices";
        return h > 0 ? h : -1;
    }
    return 0;
}

static int add_stop(aici_gen *g, aici_json v) {
    uint32_t n;
    char *s = aici_json_str(v, &n);
    if (!s || !n) {
        free(s);
        return 0;
    }
    g->stops = realloc(g->stops, (g->n_stops + 1) * sizeof(char *));
    g->stops[g->n_stops++] = s;
    return 1;
}

int aici_gen_init(aici_gen *g, aici_json spec, const char **err) {
    memset(g, 0, sizeof *g);
    g->start = aici_n_tokens;
    if (aici_json_type(spec) != AICI_J_OBJECT) {
        *err = "generation spec must be a JSON object";
        return 0;
    }
    aici_json v;
    int64_t mt;
    if (aici_json_get(spec, "max_tokens", &v)) {
        if (!aici_json_int(v, &mt) || mt < 0 || mt > 0x7FFFFFFF) {
            *err = "max_tokens must be a non-negative integer";
            return 0;
        }
        g->max_tokens = (uint32_t)mt;
    }
    if (aici_json_get(spec, "stop", &v) || aici_json_get(spec, "stop_at", &v)) {
        if (aici_json_type(v) == AICI_J_ARRAY) {
            aici_json_iter it = {0};
            aici_json e;
            while (aici_json_next(v, &it, NULL, &e))
                if (!add_stop(g, e)) {
                    *err = "stop strings must be non-empty strings";
                    return 0;
                }
        } else if (aici_json_type(v) != AICI_J_NULL && !add_stop(g, v)) {
            *err = "stop must be a non-empty string or an array of them";
            return 0;
        }
    }
    if (aici_json_get(spec, "fast_forward", &v)) {
        if (aici_json_type(v) != AICI_J_TRUE && aici_json_type(v) != AICI_J_FALSE) {
            *err = "fast_forward must be true or false";
            return 0;
        }
        g->fast_forward = aici_json_type(v) == AICI_J_TRUE;
    }
    g->constraint = aici_constraint_from_json(spec, err);
    if (g->constraint < 0) return 0;
    if (g->max_tokens == 0 && aici_json_get(spec, "max_tokens", &v)) g->done = 1;
    return 1;
}

/* Tokens post_process may take before it must look at them (stop strings) or reach max_tokens (UINT32_MAX: any). */
static uint32_t room(const aici_gen *g) {
    return g->n_stops ? 0 : g->max_tokens ? g->max_tokens - g->n_gen - 1 : UINT32_MAX;
}

aici_mid_result aici_gen_mid(aici_gen *g) {
    if (g->done) return aici_mid_stop();
    if (!g->constraint) return aici_mid_sample();   /* the SDK sends an all-allowed mask */
    if (g->fast_forward) {
        /* as many as the host's fast path splices: the declared post_process tokens + 1 */
        uint32_t r = room(g), cap = (r < AICI_DECLARE_POST_MAX ? r : AICI_DECLARE_POST_MAX) + 1;
        uint32_t n = aici_constraint_ff_tokens(g->constraint, g->ff, cap);
        if (n >= AICI_FF_MIN) return aici_mid_splice(0, g->ff, n);
    }
    int32_t r = aici_constraint_return_bias(g->constraint);
    if (r < 0) aici_logs("aici gen: constraint error while computing the mask\n");
    if (r != AICI_C_OK) g->done = 1;
    return g->done ? aici_mid_stop() : aici_mid_sample();
}

/* Offset of the first stop string in text, or len. */
static uint32_t stop_offset(aici_gen *g, const char *text, uint32_t len) {
    uint32_t best = len;
    for (uint32_t k = 0; k < g->n_stops; k++) {
        uint32_t sl = (uint32_t)strlen(g->stops[k]);
        for (uint32_t i = 0; i + sl <= len && i < best; i++)
            if (memcmp(text + i, g->stops[k], sl) == 0) {
                best = i;
                break;
            }
    }
    return best;
}

static char *gen_text(aici_gen *g, uint32_t *full, uint32_t *len) {
    aici_buf b = {0};
    aici_buf_put(&b, "", 0);
    if (g->start < aici_n_tokens) aici_detokenize(&b, aici_tokens + g->start, aici_n_tokens - g->start);
    *full = b.n;
    b.n = stop_offset(g, b.p, b.n);
    b.p[b.n] = 0;
    *len = b.n;
    return b.p;
}

int aici_gen_post(aici_gen *g, const uint32_t *toks, uint32_t n) {
    if (g->done || !n) return g->done;
    g->n_gen += n;
    g->ended_by_eos = toks[n - 1] == aici_eos();
    if (g->constraint && !aici_post_committed) {
        int32_t r = aici_constraint_commit(g->constraint, toks, n);
        if (r < 0) aici_logs("aici gen: the constraint rejected the sampled tokens\n");
        if (r != AICI_C_OK) g->done = 1;
    }
    if (g->ended_by_eos) g->done = 1;
    if (g->max_tokens && g->n_gen >= g->max_tokens) g->done = 1;
    if (g->n_stops) {
        uint32_t full, len;
        char *t = gen_text(g, &full, &len);
        if (len < full) g->done = 1;   /* a stop string cut the text */
        free(t);
    }
    return g->done;
}

void aici_gen_declare(const aici_gen *g) {
    int32_t h = g->done ? 0 : g->constraint;
    /* not done: n_gen < max_tokens, and max_tokens - n_gen - 1 more tokens cannot reach it */
    aici_declare_constraint(h, g->fast_forward ? AICI_DECLARE_MASK_FF : AICI_DECLARE_MASK, room(g));
}

char *aici_gen_text(aici_gen *g, uint32_t *len) {
    uint32_t full, l;
    char *t = gen_text(g, &full, &l);
    if (len) *len = l;
    return t;
}

void aici_gen_free(aici_gen *g) {
    if (g->constraint > 0) aici_constraint_free(g->constraint);
    for (uint32_t i = 0; i < g->n_stops; i++) free(g->stops[i]);
    free(g->stops);
    memset(g, 0, sizeof *g);
}
