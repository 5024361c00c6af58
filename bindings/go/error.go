package gradacc

// Error is a failed gradacc call: the status it returned and gradacc_last_error() of the thread
// that made the call, which names the function, the argument and the wrong value.
type Error struct {
	Status  Status
	Message string
}

func (e *Error) Error() string {
	return e.Status.String() + ": " + e.Message
}

// Is makes errors.Is(err, &gradacc.Error{Status: s}) match any error with status s.
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	return ok && t.Status == e.Status && t.Message == ""
}
